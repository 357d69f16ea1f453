"""Past one machine: a coordinator (today's server plus a registry of data nodes) and data nodes
(Flight servers holding the by-reference values written on their machine). See
docs/scale-out.md and the "Scale-out" part of docs/protocol.md.

Nothing here imports Ray; :mod:`flight_server.cluster.ray_cluster` places these servers on a Ray
cluster and imports Ray only when called.
"""
