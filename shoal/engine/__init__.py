"""The engine: requests, KV blocks, scheduling and the step loop.

`sequence`, `hashing`, `block_pool`, `kv_cache_manager` and `scheduler` are pure Python (no
torch), so property tests can explore thousands of schedules quickly.
"""
