"""Topology: how a deployment wraps the one engine from outside.

`make_engine` (data_parallel.py) builds the engine a deployment needs: one `LLMEngine`, or
`--data-parallel-size` replicas behind a prefix-affinity router (router.py), some of them on
other nodes (remote_replica.py is the API node's end, replica_node.py the other node's). With
`--nnodes`, the hosts but rank 0 follow its step programs (follower.py). Nothing here is a
branch in the engine loop; the engine (jaxllm/engine/) never imports this package.
"""
