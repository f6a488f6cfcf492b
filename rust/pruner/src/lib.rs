//! DART draft-tree pruner (being written).
