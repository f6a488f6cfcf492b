//! numpy arrays as Rust slices.

use numpy::ndarray::Dimension;
use numpy::{Element, PyReadonlyArray, PyUntypedArrayMethods};

/// The elements of `a` in row-major order without a copy, or None when `a` is not
/// C-contiguous. (`as_slice` alone also accepts Fortran order, whose elements it would hand
/// over transposed.)
pub(crate) fn c_order<'a, T: Element, D: Dimension>(
    a: &'a PyReadonlyArray<'_, T, D>,
) -> Option<&'a [T]> {
    if a.is_c_contiguous() {
        a.as_slice().ok()
    } else {
        None
    }
}
