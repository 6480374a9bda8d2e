"""KV-cache policy layer (no K/V arrays): slot table, eviction policies, saliency tracking."""
from .manager import Admission, KVManager
from .policies import POLICIES, SEMANTIC_EVICT, FrameOrder, check_policy, choose_victim
from .saliency import SaliencyTracker
from .slot_table import SlotTable, check_geometry

__all__ = ["Admission", "KVManager", "POLICIES", "SEMANTIC_EVICT", "FrameOrder", "check_policy", "choose_victim",
           "SaliencyTracker", "SlotTable", "check_geometry"]
