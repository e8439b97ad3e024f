"""Groups, the segment tree, and packing segments into rows (no model code here)."""

from sharedprefix.layout.groups import Group, validate_groups
from sharedprefix.layout.packing import RowLayout, pack_row
from sharedprefix.layout.rows import Tree
from sharedprefix.layout.tree import OutRow, Segment, SegmentTree

__all__ = ["Group", "OutRow", "RowLayout", "Segment", "SegmentTree", "Tree", "pack_row", "validate_groups"]
