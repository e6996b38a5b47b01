"""The KV offload tier (LMCache-style): full KV blocks kept below the block pool, in host memory, on disk (and in
Redis), keyed by the prefix cache's chained block hashes, and loaded back instead of recomputed (docs/kv_offload.md).
"""

from .config import KVOffloadConfig
from .offloader import KVOffloader
from .tiers import TierStats

__all__ = ["KVOffloadConfig", "KVOffloader", "TierStats"]
