"""The wire protocol in code: every message of docs/protocol.md, encoded and decoded here.

The server, its Python clients and the cluster (coordinator, data nodes, cluster client) build
and read their messages through this package only; no other module turns wire bytes into JSON
or back (tests/flight_server/test_wire.py checks that). Decoding a client's message checks it
and raises :class:`store.errors.InvalidArgument` naming the bad value and what was expected;
decoding a server's answer raises :class:`store.errors.ExpstoreError` when it is malformed.

=========================  =================================================================
module                     messages
=========================  =================================================================
:mod:`.codec`              JSON as it is written and read: requests strictly, answers leniently
:mod:`.tickets`            ``do_get`` tickets: SQL, a claim as a stream, a data node's fetch
:mod:`.actions`            ``do_action`` bodies and answers, the claim header, claim streams
:mod:`.session`            action sessions: framing, requests, answers, closing
:mod:`.subscribe`          subscriptions: the command, micro-batch metadata, messages both ways
:mod:`.puts`               ``do_put`` answers; a data node's put command and answers
:mod:`.errors`             error codes ↔ Flight errors and error payloads
=========================  =================================================================
"""
from __future__ import annotations

from .actions import (ACTION_FIELDS, CLAIM_ID_KEY, CONSUMER_KEY, EXPIRES_AT_KEY, ClaimBody,
                      ClaimHeader, action, check_body, check_fields, claim_body, claim_request,
                      claim_many_body, claim_of_results, claim_of_stream, claim_results,
                      claim_stream_table, encode_body, flag, json_result, parse_body,
                      parse_claim_body, parse_claim_many_body, results_bytes, schema_fingerprint,
                      table_def)
from .codec import decode_answer, encode, encode_answer
from .errors import code_of, error_doc, error_of_doc, flight_error, from_flight
from .puts import (chunks_of_answer, node_put_answer, parse_put_answer, parse_put_command,
                   put_answer, put_command, put_command_of, put_error_answer)
from .session import (SESSION_COMMAND, SessionAnswer, SessionRequest, frame, is_session,
                      split_parts)
from .subscribe import (MULTI_SCHEMA, ClientMessage, MicroBatchMeta, SubscribeOptions,
                        parse_subscribe)
from .tickets import (MAX_TICKET_BYTES, ClaimTicket, FetchColumn, FetchTicket, SqlTicket,
                      claim_ticket, is_claim_ticket, parse_fetch_ticket, parse_ticket,
                      sql_ticket, table_ticket, ticket_document)

__all__ = [
    "ACTION_FIELDS", "CLAIM_ID_KEY", "CONSUMER_KEY", "ClaimBody", "ClaimHeader", "ClaimTicket",
    "ClientMessage", "EXPIRES_AT_KEY", "FetchColumn", "FetchTicket", "MAX_TICKET_BYTES",
    "MULTI_SCHEMA", "MicroBatchMeta", "SESSION_COMMAND", "SessionAnswer", "SessionRequest",
    "SqlTicket", "SubscribeOptions", "action", "check_body", "check_fields",
    "chunks_of_answer", "claim_body", "claim_many_body", "claim_of_results", "claim_of_stream",
    "claim_request", "claim_results", "claim_stream_table", "claim_ticket", "code_of",
    "decode_answer", "encode", "encode_answer", "encode_body", "error_doc", "error_of_doc",
    "flag", "flight_error", "frame", "from_flight", "is_claim_ticket", "is_session",
    "json_result", "node_put_answer", "parse_body", "parse_claim_body",
    "parse_claim_many_body", "parse_fetch_ticket", "parse_put_answer", "parse_put_command",
    "parse_subscribe", "parse_ticket", "put_answer", "put_command", "put_command_of",
    "put_error_answer", "results_bytes", "schema_fingerprint", "split_parts", "sql_ticket",
    "table_def", "table_ticket", "ticket_document",
]
