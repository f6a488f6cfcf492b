//! Cephes' `expf` constants, shared by the kernels' exponentials (the tree attention's AVX-512
//! softmax, the element-wise SiLU): e^x = 2^n e^r with n = round(x / ln 2), r = x - n ln 2
//! (ln 2 split in two so n ln 2 subtracts exactly) and e^r = 1 + r + r² p(r).

/// ln 2's high part (exact in few bits, so `n * LN2_HI` is exact).
pub(crate) const LN2_HI: f32 = 0.693_359_4;
/// ln 2 minus [`LN2_HI`].
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// p's coefficients, highest degree first (Horner's order).
pub(crate) const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
