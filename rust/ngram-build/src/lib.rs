//! Building DART n-gram models (being written).
