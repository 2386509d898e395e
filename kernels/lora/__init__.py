"""Batched multi-LoRA: each step's metadata (which rows use which adapter slot), the shrink
(x @ A.T) and expand (h @ B.T) of every row's adapter, read from arenas of rank rows shared by
all adapters (rows.py), and a delta left unexpanded for the op after a projection to expand."""
from .delta import ColumnSplit, LoraDelta, scaled_shrink, with_delta
from .dispatch import add_lora, lora_expand, lora_shrink, lora_shrink_partials, lora_workspace_numel
from .meta import MAX_SPLIT_K, MODULE_COLUMNS, SEGMENT_TABLE_RANKS, HostSegment, LoraBatchMeta
from .rows import SlotRows, gather_rows

__all__ = ["ColumnSplit", "HostSegment", "LoraBatchMeta", "LoraDelta", "MAX_SPLIT_K",
           "MODULE_COLUMNS", "SEGMENT_TABLE_RANKS", "SlotRows", "add_lora", "gather_rows",
           "lora_expand", "lora_shrink", "lora_shrink_partials", "lora_workspace_numel",
           "scaled_shrink", "with_delta"]
