// A rollout worker and a trainer in Node.js, talking to an expstore server over Arrow Flight.
//
//   node rollout_and_train.mjs HOST:PORT [TABLE]
//
// It follows docs/protocol.md and nothing else: no expstore code runs on this side, only gRPC
// (@grpc/grpc-js with Arrow Flight's service definition, flight.proto) and Arrow IPC
// (apache-arrow). It creates a table, writes rollouts in two parts with do_put, claims a
// micro-batch, acks it, bumps the policy version, writes, claims and acks the next version's
// rollout on an action session, reads the rows back with SQL, makes two bad requests (a claim
// of an unknown table, a put of a malformed sample id), and prints a JSON summary of everything
// it saw on stdout. The server must run without auth and TLS (docs/protocol.md, "Connecting").
import { fileURLToPath } from 'node:url';
import path from 'node:path';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';
import {
  Dictionary, Field, Float32, Float64, Int32, List, Message, Table, Utf8,
  tableFromIPC, tableToIPC, vectorFromArray,
} from 'apache-arrow';

const HERE = path.dirname(fileURLToPath(import.meta.url));

// -- Arrow Flight over gRPC -----------------------------------------------------------------------
function flightClient(target) {
  const definition = protoLoader.loadSync(path.join(HERE, 'flight.proto'), {
    keepCase: true, longs: String, enums: String, defaults: true,
  });
  const { FlightService } = grpc.loadPackageDefinition(definition).arrow.flight.protocol;
  return new FlightService(target, grpc.credentials.createInsecure());
}

const json = (value) => Buffer.from(JSON.stringify(value), 'utf8');
const parse = (bytes) => JSON.parse(Buffer.from(bytes).toString('utf8'));

/** do_action: the bodies of every Result, in order (docs/protocol.md, "do_action"). */
function doAction(client, type, body) {
  return new Promise((resolve, reject) => {
    const bodies = [];
    const call = client.DoAction({ type, body: json(body) });
    call.on('data', (result) => bodies.push(result.body));
    call.on('error', reject);
    call.on('end', () => resolve(bodies));
  });
}

async function actionJson(client, type, body) {
  const bodies = await doAction(client, type, body);
  if (bodies.length !== 1) throw new Error(`${type}: expected one result, got ${bodies.length}`);
  return parse(bodies[0]);
}

// -- Arrow IPC: a stream <-> its encapsulated messages -------------------------------------------
const CONTINUATION = 0xffffffff;
const END_OF_STREAM = Buffer.from([0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);

/**
 * Split an Arrow IPC stream into its messages: for each, the Message flatbuffer (FlightData's
 * data_header) and its body (data_body). Each message is framed as 0xFFFFFFFF, an int32 length
 * of the flatbuffer (padded to 8 bytes), the flatbuffer, then bodyLength bytes of body.
 */
function ipcMessages(stream) {
  const view = new DataView(stream.buffer, stream.byteOffset, stream.byteLength);
  const messages = [];
  let at = 0;
  while (at < stream.byteLength) {
    let length = view.getUint32(at, true);
    at += 4;
    if (length === CONTINUATION) {
      length = view.getInt32(at, true);
      at += 4;
    }
    if (length === 0) break; // end of stream
    const header = stream.subarray(at, at + length);
    const bodyLength = Number(Message.decode(header).bodyLength);
    at += length;
    const body = stream.subarray(at, at + bodyLength);
    messages.push({ header: Buffer.from(header), body: Buffer.from(body) });
    at += bodyLength;
  }
  return messages;
}

/** The inverse of ipcMessages: header/body pairs (FlightData) as an IPC stream, end marker too. */
function ipcStream(messages) {
  const parts = [];
  for (const { header, body } of messages) {
    const padding = (8 - (header.byteLength % 8)) % 8;
    const prefix = Buffer.alloc(8);
    prefix.writeUInt32LE(CONTINUATION, 0);
    prefix.writeInt32LE(header.byteLength + padding, 4);
    parts.push(prefix, header, Buffer.alloc(padding), body);
  }
  parts.push(END_OF_STREAM);
  return Buffer.concat(parts);
}

// -- the verbs ------------------------------------------------------------------------------------
/**
 * One do_put stream of several record batches to a table; the server's answer to each batch is
 * awaited before the next is sent (docs/protocol.md, "do_put"). Returns the answers.
 */
function doPut(client, table, batches) {
  const schema = batches[0].schema;
  const messages = batches.map(
    (batch) => ipcMessages(tableToIPC(new Table(schema, batch), 'stream')));
  return new Promise((resolve, reject) => {
    const answers = [];
    let answered = () => {};
    let failed = false;
    const call = client.DoPut();
    call.on('data', (put) => {
      answers.push(parse(put.app_metadata));
      answered();
    });
    call.on('error', (error) => {
      failed = true;
      answered();
      reject(error);
    });
    call.on('end', () => resolve(answers));
    (async () => {
      // The first message carries the descriptor and the schema; then come the messages of each
      // batch (its dictionaries, then the record batch), without the end-of-stream marker.
      const [schemaMessage] = messages[0];
      call.write({
        flight_descriptor: { type: 'PATH', path: [table] },
        data_header: schemaMessage.header, data_body: schemaMessage.body,
      });
      for (const [i, [, ...batchMessages]] of messages.entries()) {
        for (const { header, body } of batchMessages) {
          call.write({ data_header: header, data_body: body });
        }
        while (!failed && answers.length <= i) {
          await new Promise((next) => { answered = next; });
        }
        if (failed) return;
      }
      call.end();
    })().catch(reject);
  });
}

/** do_get of a JSON ticket: the FlightData stream reassembled into an Arrow table. */
function doGet(client, ticket) {
  return new Promise((resolve, reject) => {
    const messages = [];
    const call = client.DoGet({ ticket: json(ticket) });
    call.on('data', (data) => messages.push({ header: data.data_header, body: data.data_body }));
    call.on('error', reject);
    call.on('end', () => resolve(tableFromIPC(ipcStream(messages))));
  });
}

/** get_schema of a table's flight: its write schema (SchemaResult.schema is one IPC message). */
function getSchema(client, table) {
  return new Promise((resolve, reject) => {
    client.GetSchema({ type: 'PATH', path: [table] }, (error, result) => {
      if (error) reject(error);
      else resolve(tableFromIPC(Buffer.concat([result.schema, END_OF_STREAM])).schema);
    });
  });
}

/** A claim's answer: the JSON header, then one Arrow IPC stream per table in the header's order. */
async function claim(client, body) {
  const [header, ...streams] = await doAction(client, 'claim', body);
  const parsed = parse(header);
  const tables = {};
  Object.keys(parsed.tables).forEach((name, i) => { tables[name] = tableFromIPC(streams[i]); });
  return { header: parsed, tables };
}

/**
 * An action session (docs/protocol.md, "do_exchange: action sessions"): requests and answers as
 * metadata-only FlightData on one do_exchange stream. request() sends one and resolves with the
 * parts of its answer (what do_action would have returned), matched by id.
 */
function openSession(client) {
  const call = client.DoExchange();
  const waiting = new Map();
  let lastId = 0;
  call.on('data', (data) => {
    if (data.app_metadata.length === 0) return; // the stream's (empty) schema message
    const message = data.app_metadata;
    const newline = message.indexOf(0x0a);
    const head = parse(newline < 0 ? message : message.subarray(0, newline));
    let at = newline + 1;
    const parts = (head.sizes ?? []).map((size) => message.subarray(at, (at += size)));
    const { resolve, reject } = waiting.get(head.id);
    waiting.delete(head.id);
    if (head.error) reject(new Error(`[${head.error.code}] ${head.error.message}`));
    else resolve(parts);
  });
  const ended = new Promise((resolve, reject) => {
    call.on('error', (error) => {
      for (const { reject: fail } of waiting.values()) fail(error);
      reject(error);
    });
    call.on('end', resolve);
  });
  // The first message names the session; its app_metadata would not be read, so requests
  // start with the second.
  call.write({ flight_descriptor: { type: 'CMD', cmd: json({ session: {} }) } });
  return {
    request(action, body, part) {
      const id = ++lastId;
      const head = json(part ? { id, action, body, sizes: [part.byteLength] }
        : { id, action, body });
      return new Promise((resolve, reject) => {
        waiting.set(id, { resolve, reject });
        call.write({ app_metadata: part ? Buffer.concat([head, Buffer.from('\n'), part]) : head });
      });
    },
    close() {
      call.end();
      return ended;
    },
  };
}

/**
 * What a call that should fail failed with: the gRPC status code and message, and the Flight
 * error's extra_info, which gRPC carries in the trailer grpc-status-details-bin.
 */
async function failure(promise) {
  try {
    await promise;
  } catch (error) {
    if (error.code === undefined) throw error; // not a gRPC status
    const extra = error.metadata?.get('grpc-status-details-bin')?.[0];
    return {
      grpc_code: error.code,
      grpc_code_name: grpc.status[error.code],
      message: error.details,
      extra_info: extra === undefined ? null : parse(extra),
    };
  }
  return null; // it did not fail
}

// -- values as JSON -------------------------------------------------------------------------------
function plain(value) {
  if (typeof value === 'bigint') return Number(value);
  if (value !== null && typeof value === 'object' && typeof value.toArray === 'function') {
    return Array.from(value.toArray(), plain);
  }
  return value;
}

function rows(table) {
  return table.toArray().map((row) => Object.fromEntries(
    table.schema.fields.map((f) => [f.name, plain(row[f.name])])));
}

const listOf = (type) => new List(new Field('item', type, true));
function batchOf(columns) {
  const vectors = Object.fromEntries(Object.entries(columns).map(
    ([name, [type, values]]) => [name, vectorFromArray(values, type)]));
  return new Table(vectors).batches[0];
}

// -- the session ----------------------------------------------------------------------------------
async function main() {
  const [target, table = 'node_rollouts'] = process.argv.slice(2);
  if (!target || !/^[^:/]+:\d+$/.test(target)) {
    throw new Error(
      `usage: node rollout_and_train.mjs HOST:PORT [TABLE]; got ${JSON.stringify(target)}`);
  }
  const client = flightClient(target);
  const summary = { table };

  const created = await actionJson(client, 'create_table', {
    name: table,
    columns: { prompt: 'string', response: 'string', reward: 'float64',
      token_ids: 'list<int32>', logprobs: 'list<float32>' },
    lease_seconds: 60,
  });
  summary.created = {
    version: created.version, columns: created.columns.map((c) => [c.name, c.type]),
  };
  const writeSchema = await getSchema(client, table);
  summary.write_schema = writeSchema.fields.map((f) => [f.name, String(f.type)]);

  // Rollouts written in two parts: the prompts first (one stream of two batches), then the
  // responses with their rewards, token ids and logprobs.
  const ids = ['q1_0_0', 'q1_0_1', 'q2_0_0', 'q2_0_1'];
  // A prompt repeats for each of its trajectories: dictionary-encoded, as Arrow JS encodes
  // strings by default. The batches of one stream share the type (its dictionary id), and each
  // carries its own dictionary before it (a replacement, in IPC terms).
  const promptType = new Dictionary(new Utf8(), new Int32());
  const prompts = (first, text) => batchOf({
    sample_id: [new Utf8(), ids.slice(first, first + 2)], prompt: [promptType, [text, text]],
  });
  const finished = batchOf({
    sample_id: [new Utf8(), ids],
    response: [new Utf8(), ['2', 'two', 'ok ✓', 'OK']],
    reward: [new Float64(), [1.0, 0.5, 0.25, -1.5]],
    token_ids: [listOf(new Int32()), [[17, 4, 2], [], [9, 2147483647, -3], [5]]],
    logprobs: [listOf(new Float32()), [[-0.5, -1.25], [-0.125], [], [-2.0, -0.75, -0.0625]]],
  });
  summary.put_answers = [
    await doPut(client, table, [prompts(0, '1+1?'), prompts(2, 'say "ok" in ünïcode')]),
    await doPut(client, table, [finished]),
  ];

  // The trainer: one micro-batch of 3 rows, acked, then the version bumped.
  const { header, tables } = await claim(client, { table, limit: 3, consumer: 'node-trainer' });
  const claimed = tables[table];
  summary.claim = {
    claim_id: header.claim_id,
    consumer: header.consumer,
    tables: header.tables,
    expires_in_future: header.expires_at > Date.now() / 1000,
    schema_table: claimed.schema.metadata.get('expstore.table'),
    columns: claimed.schema.fields.map((f) => f.name),
    rows: rows(claimed).map(
      ({ sample_id, input_id, trajectory_id, reward, token_ids, delivery_count }) => (
        { sample_id, input_id, trajectory_id, reward, token_ids, delivery_count })),
  };
  summary.ack = await actionJson(client, 'ack', { claim_id: header.claim_id });
  summary.bump = await actionJson(client, 'bump_version', { table, expected: 0 });

  // The next version's rollout and micro-batch on one action session: a put, a claim, an ack.
  const session = openSession(client);
  const late = batchOf({
    sample_id: [new Utf8(), ['q3_0_0']],
    prompt: [new Utf8(), ['3+3?']],
    response: [new Utf8(), ['6']],
    reward: [new Float64(), [0.75]],
    token_ids: [listOf(new Int32()), [[6, 0]]],
    logprobs: [listOf(new Float32()), [[-0.25]]],
  });
  const [putAnswer] = await session.request(
    'put', { table }, tableToIPC(new Table(late), 'stream'));
  const [sessionHeader, sessionRows] = await session.request(
    'claim', { table, limit: 2, consumer: 'node-trainer' });
  const sessionClaim = parse(sessionHeader);
  const [sessionAck] = await session.request('ack', { claim_id: sessionClaim.claim_id });
  await session.close();
  summary.session = {
    put: parse(putAnswer),
    claim: { claim_id: sessionClaim.claim_id, tables: sessionClaim.tables,
      sample_ids: rows(tableFromIPC(sessionRows)).map((r) => r.sample_id) },
    ack: parse(sessionAck),
  };

  const read = await doGet(client, {
    sql: `SELECT sample_id, prompt, response, reward, token_ids, logprobs, policy_version, consumed
          FROM "${table}" ORDER BY sample_id`,
  });
  summary.sql_rows = rows(read);

  // Bad requests: the typed errors the doc promises, as gRPC delivers them.
  summary.error = await failure(claim(client, { table: 'no_such_table', limit: 1 }));
  summary.put_error = await failure(doPut(client, table, [batchOf({
    sample_id: [new Utf8(), ['q4_00_0']], prompt: [new Utf8(), ['a turn written as 00']],
  })]));
  client.close();
  process.stdout.write(`${JSON.stringify(summary, null, 2)}\n`);
}

main().catch((error) => {
  process.stderr.write(`rollout_and_train: ${error.stack ?? error}\n`);
  process.exit(1);
});
