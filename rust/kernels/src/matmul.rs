//! `out = x · Wᵀ (+ bias)` for bf16 weights and a few bf16 rows, accumulated in f32.
//!
//! Layout. The weight `W` (`n` outputs × `k` inputs, row-major as PyTorch stores an
//! `nn.Linear`) is cut into panels of [`PANEL_COLUMNS`] outputs. A panel stores, for every
//! pair of inputs `(2p, 2p+1)`, the 32 outputs' two weights side by side: one 32-bit lane
//! holds `W[c, 2p]` in its low half and `W[c, 2p+1]` in its high half, so a shift and a mask
//! turn one 64-byte load into 16 f32 weights of input `2p` and 16 of input `2p+1`. Panels
//! follow each other in memory, so a call streams the matrix once from start to end; the
//! kernel prefetches [`PREFETCH_BYTES`] ahead because the hardware prefetcher alone left a
//! third of the memory bandwidth unused, and when a panel takes several passes (the dot
//! kernel's row passes, the AVX2 kernel's quarter groups), the next panel during them
//! ([`Prefetch`]). Odd `k` and the last panel are padded with zeros.
//!
//! Order of operations. Every output is `bias` (or 0) followed by one f32 FMA per input, in
//! input order, rounded to bf16 once at the end. Nothing depends on `m` or on which rows are
//! multiplied together, so the SIMD kernels (AVX-512, AVX2) and the scalar one give the same
//! bits, and a row's result is the same in a tree of 30 rows as alone.
//!
//! AMX. On CPUs with AMX-BF16 (Sapphire Rapids and later) the same layout is what a tile
//! multiplication reads: 16 consecutive input pairs of a panel's first (or last) 16 outputs
//! are one `16 x 64 B` tile at a stride of one pair's 128 bytes, so panels are padded to whole
//! blocks of [`PAIRS_PER_BLOCK`] pairs. `tdpbf16ps` multiplies up to 16 rows by such a tile
//! for the cost of one, so up to [`AMX_ROWS_PER_PASS`] rows stream the weights once and cost
//! about what one row does. Its sums are rounded differently from the FMA chain (products of
//! pairs, denormals flushed), so the AMX kernel's bits are its own, but they too depend on
//! nothing but the row itself and the input blocks in order: a row's result is the same
//! alone as in a tree, which is the property DART needs.

use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::error::{check_len, KernelError, Result};

/// Outputs per panel: two 16-lane f32 accumulators per row.
pub const PANEL_COLUMNS: usize = 32;
/// Rows multiplied per pass over a panel: 12 rows x 2 accumulators + 4 weight registers fill
/// 28 of AVX-512's 32 registers. More rows take several passes (the panel is then in cache).
pub const MAX_ROWS_PER_PASS: usize = 12;
/// Rows per pass of the AVX512-BF16 kernel: 9-12 rows ran at less than half the speed of 8
/// on a Zen 4 EPYC (two passes of 8 at 2.0x the FMA kernel's speed, one of 12 at 1.0x).
pub const DOT_ROWS_PER_PASS: usize = 8;
/// How far ahead of the loads the kernel prefetches (measured best of 0.5-4 KiB on SmolLM2).
const PREFETCH_BYTES: usize = 4096;
/// u16 per input pair of a panel: 32 outputs x 2 inputs.
const PAIR_STRIDE: usize = PANEL_COLUMNS * 2;
/// Panels hold whole blocks of this many input pairs (zero-padded): one AMX tile's rows.
pub const PAIRS_PER_BLOCK: usize = 16;
/// Rows multiplied per pass over the weights by the AMX kernel: two tiles of 16 rows.
pub const AMX_ROWS_PER_PASS: usize = 32;

/// One cache line of packed weights; the matrix is a vector of them so loads never straddle
/// two lines.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([u16; 32]);

/// Which implementation multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The best one this CPU runs: AMX, else AVX-512, else AVX2, else scalar
    /// ([`Backend::best`]).
    Auto,
    /// AMX-BF16 tiles (x86-64 Linux, with AVX-512 for the conversions).
    Amx,
    /// AVX512-BF16 dot products (`vdpbf16ps`: AMD Zen 4 and later, Intel Cooper Lake and
    /// later), two inputs per instruction on the bf16 rows as they are; its own bits.
    Avx512Bf16,
    /// AVX-512F/BW/VL (x86-64 only).
    Avx512,
    /// AVX2 and FMA (x86-64 only: AMD Zen 1-3, Intel client cores without AVX-512); the same
    /// bits as [`Backend::Avx512`], 8 lanes at a time.
    Avx2,
    /// Portable Rust; the same bits as [`Backend::Avx512`], much slower.
    Scalar,
}

impl Backend {
    /// Whether the AVX512-BF16 kernel runs on this CPU.
    pub fn avx512_bf16_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            avx512bf16::available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether the AVX-512 kernel runs on this CPU.
    pub fn avx512_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            avx512::available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether the AVX2 kernel runs on this CPU (AVX2 and FMA).
    pub fn avx2_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            avx2::available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether this CPU runs a SIMD kernel ([`Backend::best`] is not the scalar one): the
    /// decoding kernels are then fast enough to replace PyTorch's.
    pub fn any_simd_available() -> bool {
        Self::best() != Backend::Scalar
    }

    /// Whether the AMX kernel runs here: the CPU has AMX-BF16 and AVX-512, and the OS let this
    /// process use tile data (asked once).
    pub fn amx_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            amx::available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// The backends this CPU runs, the most capable first (scalar always last), whatever
    /// `DART_MAX_CPU_ISA` says.
    pub fn runnable() -> Vec<Backend> {
        [
            (Backend::Amx, Self::amx_available()),
            (Backend::Avx512Bf16, Self::avx512_bf16_available()),
            (Backend::Avx512, Self::avx512_available()),
            (Backend::Avx2, Self::avx2_available()),
            (Backend::Scalar, true),
        ]
        .into_iter()
        .filter_map(|(b, available)| available.then_some(b))
        .collect()
    }

    /// What [`Backend::Auto`] runs on this CPU: the most capable backend it runs, at most
    /// the one the environment variable `DART_MAX_CPU_ISA` names (as `ONEDNN_MAX_CPU_ISA`
    /// caps oneDNN: to reproduce another CPU's kernels, or to measure them side by side). A
    /// value naming no backend is ignored here and reported by [`Backend::max_isa`].
    pub fn best() -> Backend {
        static BEST: OnceLock<Backend> = OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = Self::max_isa().ok().flatten().unwrap_or(Backend::Amx);
            Self::runnable()
                .into_iter()
                .find(|b| b.rank() <= cap.rank())
                .unwrap_or(Backend::Scalar)
        })
    }

    /// The cap `DART_MAX_CPU_ISA` sets on [`Backend::best`]: None when unset or empty, an
    /// error when it names no backend ("auto" included: it is not a cap).
    pub fn max_isa() -> Result<Option<Backend>> {
        Self::parse_max_isa(std::env::var("DART_MAX_CPU_ISA").ok())
    }

    fn parse_max_isa(value: Option<String>) -> Result<Option<Backend>> {
        match value {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => Ok(None),
            Some(v) => match Self::from_name(&v.trim().to_ascii_lowercase()) {
                Some(Backend::Auto) | None => Err(KernelError::MaxIsa(v)),
                Some(b) => Ok(Some(b)),
            },
        }
    }

    /// How much a backend asks of the CPU: each needs what the ones below it need.
    fn rank(self) -> u8 {
        match self {
            Backend::Scalar => 0,
            Backend::Avx2 => 1,
            Backend::Avx512 => 2,
            Backend::Avx512Bf16 => 3,
            Backend::Amx | Backend::Auto => 4,
        }
    }

    /// Every backend, in the order [`Backend::name`] lists them.
    pub const ALL: [Backend; 6] = [
        Backend::Auto,
        Backend::Amx,
        Backend::Avx512Bf16,
        Backend::Avx512,
        Backend::Avx2,
        Backend::Scalar,
    ];

    /// The backend's name as the bindings and logs spell it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Amx => "amx",
            Backend::Avx512Bf16 => "avx512bf16",
            Backend::Avx512 => "avx512",
            Backend::Avx2 => "avx2",
            Backend::Scalar => "scalar",
        }
    }

    /// The backend [`Backend::name`] spells `name`.
    pub fn from_name(name: &str) -> Option<Backend> {
        Self::ALL.into_iter().find(|b| b.name() == name)
    }
}

/// A bf16 weight matrix packed for [`PackedMatrix::matmul`].
pub struct PackedMatrix {
    out_features: usize,
    in_features: usize,
    pairs: usize,
    /// `pairs` rounded up to whole blocks: a panel's length in pairs.
    panel_pairs: usize,
    panels: usize,
    lines: Vec<Line>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("out_features", &self.out_features)
            .field("in_features", &self.in_features)
            .finish()
    }
}

impl PackedMatrix {
    /// Packs `weight`, the bf16 bits of an `out_features x in_features` row-major matrix.
    pub fn pack(weight: &[u16], out_features: usize, in_features: usize) -> Result<Self> {
        positive("out_features", out_features)?;
        positive("in_features", in_features)?;
        let expected = out_features
            .checked_mul(in_features)
            .ok_or(KernelError::Dimension {
                what: "out_features x in_features",
                max: usize::MAX,
                got: usize::MAX,
            })?;
        check_len("weight", weight.len(), expected)?;
        let pairs = in_features.div_ceil(2);
        let panel_pairs = pairs.next_multiple_of(PAIRS_PER_BLOCK);
        let panels = out_features.div_ceil(PANEL_COLUMNS);
        let lines_per_pair = PAIR_STRIDE / 32;
        let mut lines = vec![Line::default(); panels * panel_pairs * lines_per_pair];
        let flat: &mut [u16] = lines_as_u16_mut(&mut lines);
        flat.par_chunks_mut(panel_pairs * PAIR_STRIDE)
            .enumerate()
            .for_each(|(panel, dst)| {
                for column in 0..PANEL_COLUMNS {
                    let row = panel * PANEL_COLUMNS + column;
                    if row >= out_features {
                        break;
                    }
                    let src = &weight[row * in_features..(row + 1) * in_features];
                    for (input, &w) in src.iter().enumerate() {
                        dst[(input / 2) * PAIR_STRIDE + column * 2 + input % 2] = w;
                    }
                }
            });
        Ok(Self {
            out_features,
            in_features,
            pairs,
            panel_pairs,
            panels,
            lines,
        })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Bytes of the packed copy.
    pub fn packed_bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
    }

    /// `out = x · Wᵀ + bias` for `x` of `rows x in_features` bf16 bits, `bias` of
    /// `out_features`, `out` of `rows x out_features` (all row-major), on `threads` threads
    /// (1: the calling thread only).
    pub fn matmul(
        &self,
        x: &[u16],
        rows: usize,
        bias: Option<&[u16]>,
        out: &mut [u16],
        threads: usize,
    ) -> Result<()> {
        self.matmul_with(Backend::Auto, x, rows, bias, out, threads)
    }

    /// [`PackedMatrix::matmul`] with a chosen backend (tests and benchmarks compare them).
    pub fn matmul_with(
        &self,
        backend: Backend,
        x: &[u16],
        rows: usize,
        bias: Option<&[u16]>,
        out: &mut [u16],
        threads: usize,
    ) -> Result<()> {
        positive("rows", rows)?;
        check_len("x", x.len(), rows * self.in_features)?;
        check_len("out", out.len(), rows * self.out_features)?;
        if let Some(b) = bias {
            check_len("bias", b.len(), self.out_features)?;
        }
        let backend = match backend {
            Backend::Auto => Backend::best(),
            Backend::Amx if !Backend::amx_available() => {
                return Err(KernelError::Unavailable("AMX-BF16"))
            }
            Backend::Avx512Bf16 if !Backend::avx512_bf16_available() => {
                return Err(KernelError::Unavailable("AVX512-BF16"))
            }
            Backend::Avx512 if !Backend::avx512_available() => {
                return Err(KernelError::Unavailable("AVX-512"))
            }
            Backend::Avx2 if !Backend::avx2_available() => {
                return Err(KernelError::Unavailable("AVX2 and FMA"))
            }
            chosen => chosen,
        };
        let bias_f32: Option<Vec<f32>> = bias.map(|b| {
            let mut v = vec![0f32; self.panels * PANEL_COLUMNS];
            for (d, &s) in v.iter_mut().zip(b) {
                *d = bf16_to_f32(s);
            }
            v
        });
        // AMX reads the rows as bf16 in whole blocks of inputs, the dot-product kernel in whole
        // pairs: `x` itself when its rows are exactly that long (the usual model widths),
        // otherwise a zero-padded copy.
        let padded_bf16: Vec<u16>;
        let xf: Vec<f32>;
        let bf16_stride = match backend {
            Backend::Amx => Some(self.panel_pairs * 2),
            Backend::Avx512Bf16 => Some(self.pairs * 2),
            _ => None,
        };
        let kernel = if let Some(stride) = bf16_stride {
            let x = if stride == self.in_features {
                x
            } else {
                let mut padded = vec![0u16; rows * stride];
                for (dst, src) in padded.chunks_mut(stride).zip(x.chunks(self.in_features)) {
                    dst[..src.len()].copy_from_slice(src);
                }
                padded_bf16 = padded;
                &padded_bf16
            };
            if backend == Backend::Amx {
                Kernel::Amx { x, stride }
            } else {
                Kernel::Dot { x, stride }
            }
        } else {
            // Inputs as f32, each row padded to whole pairs.
            let stride = self.pairs * 2;
            let mut converted = vec![0f32; rows * stride];
            for (dst, src) in converted.chunks_mut(stride).zip(x.chunks(self.in_features)) {
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = bf16_to_f32(s);
                }
            }
            xf = converted;
            Kernel::Fma {
                x: &xf,
                stride,
                backend,
            }
        };
        let job = Job {
            matrix: self,
            kernel,
            rows,
            bias: bias_f32.as_deref(),
            out: SharedOut(out.as_mut_ptr()),
        };
        let threads = threads.clamp(1, self.panels);
        if threads == 1 {
            job.run(0..self.panels);
        } else {
            let per = self.panels.div_ceil(threads);
            pool(threads).install(|| {
                (0..threads).into_par_iter().for_each(|t| {
                    let start = (t * per).min(self.panels);
                    job.run(start..((t + 1) * per).min(self.panels));
                })
            });
        }
        Ok(())
    }

    fn panel_lines(&self, panel: usize) -> &[Line] {
        let per_panel = self.panel_pairs * PAIR_STRIDE / 32;
        &self.lines[panel * per_panel..(panel + 1) * per_panel]
    }
}

/// How a kernel walks a panel: rows per pass, and whether its passes stream the next panel
/// ([`Prefetch`]).
#[derive(Clone, Copy)]
struct Passes {
    rows: usize,
    stream_next: bool,
}

/// One matmul call, split by panels across threads. Each panel writes only its own columns.
struct Job<'a> {
    matrix: &'a PackedMatrix,
    kernel: Kernel<'a>,
    rows: usize,
    bias: Option<&'a [f32]>,
    out: SharedOut,
}

/// The kernel a call runs (available on this CPU), with the rows as it reads them, `stride`
/// elements apart.
#[derive(Clone, Copy)]
enum Kernel<'a> {
    /// Tiles over bf16 rows padded to whole blocks.
    Amx { x: &'a [u16], stride: usize },
    /// AVX512-BF16 dot products over bf16 rows padded to whole pairs.
    Dot { x: &'a [u16], stride: usize },
    /// The FMA chain over f32 rows padded to whole pairs, by `backend` (AVX-512, AVX2 or
    /// scalar: the same bits).
    Fma {
        x: &'a [f32],
        stride: usize,
        backend: Backend,
    },
}

/// `out`'s pointer, shared by the threads of one call; they write disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut u16);
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl Job<'_> {
    fn run(&self, panels: std::ops::Range<usize>) {
        match self.kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx { x, stride } => {
                // SAFETY: an Amx job is only built when amx::available(); lengths were checked.
                unsafe { amx::run(self, x, stride, panels) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Amx { .. } => unreachable!("AMX is x86-64 only"),
            Kernel::Fma { x, stride, backend } => {
                // The AVX-512 FMA chain's row passes are compute-bound: streaming the next panel
                // during them measured 3-5% slower at 32 rows on the Zen 4. (The AVX2 kernel
                // streams it within a pass, across its quarter groups.)
                let passes = Passes {
                    rows: MAX_ROWS_PER_PASS,
                    stream_next: false,
                };
                self.run_passes(x, stride, passes, panels, |tile| match backend {
                    // SAFETY: matmul_with runs these backends only where they are available.
                    #[cfg(target_arch = "x86_64")]
                    Backend::Avx512 => unsafe { avx512::tile(tile) },
                    #[cfg(target_arch = "x86_64")]
                    Backend::Avx2 => unsafe { avx2::tile(tile) },
                    _ => tile.scalar(),
                })
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Dot { x, stride } => {
                // SAFETY: a Dot job is only built when avx512bf16::available().
                let passes = Passes {
                    rows: DOT_ROWS_PER_PASS,
                    stream_next: true,
                };
                self.run_passes(x, stride, passes, panels, |tile| unsafe {
                    avx512bf16::tile(tile)
                })
            }
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Dot { .. } => unreachable!("AVX512-BF16 is x86-64 only"),
        }
    }

    /// Every panel times the rows of `x` (`x_stride` elements apart) in near-equal passes of
    /// at most `per_pass.rows` rows, each pass one `kernel` call.
    fn run_passes<X>(
        &self,
        x: &[X],
        x_stride: usize,
        per_pass: Passes,
        panels: std::ops::Range<usize>,
        kernel: impl Fn(&Tile<'_, X>),
    ) {
        let m = self.matrix;
        // Near-equal passes (the FMA kernel's 16 rows as 8 + 8 measured 8% faster than 12 + 4).
        let passes = self.rows.div_ceil(per_pass.rows);
        let first_panel = panels.start;
        for panel in panels {
            let weights = lines_as_u16(m.panel_lines(panel));
            let first_column = panel * PANEL_COLUMNS;
            let columns = (m.out_features - first_column).min(PANEL_COLUMNS);
            let bias = self
                .bias
                .map(|b| &b[first_column..first_column + PANEL_COLUMNS]);
            let mut row = 0;
            for pass in 0..passes {
                let count = self.rows / passes + usize::from(pass < self.rows % passes);
                kernel(&Tile {
                    x: &x[row * x_stride..(row + count) * x_stride],
                    x_stride,
                    weights,
                    pairs: m.pairs,
                    prefetch: Prefetch::plan(
                        weights,
                        m.pairs,
                        pass,
                        passes,
                        // The call's first panel: nothing prefetched it for its first pass.
                        per_pass.stream_next && !(panel == first_panel && pass == 0),
                    ),
                    bias,
                    // SAFETY: rows row..row+count, columns first_column..+columns are inside
                    // `out` (checked lengths) and belong to this panel alone.
                    out: unsafe { self.out.0.add(row * m.out_features + first_column) },
                    out_stride: m.out_features,
                    columns,
                    rows: count,
                });
                row += count;
            }
        }
    }
}

/// What a pass over a panel prefetches at input pair `p`: lines [`PREFETCH_BYTES`] ahead of
/// its own loads, and when the panel takes several passes, its share of the next panel.
///
/// A pass alone streams the panel from memory (and, near its end, the next panel's start).
/// With several passes, the later ones read the panel from the cache and memory would sit
/// idle: two of the passes also prefetch the *next* panel into L2 ([`Prefetch::next_share`]),
/// so the weights stream from memory while all the passes compute (on a Zen 4 core a 16-row
/// product had cost about one row's streaming plus the rows' arithmetic, not the larger of
/// the two).
#[derive(Clone, Copy)]
struct Prefetch {
    /// The two lines ahead for pair 0, if this pass prefetches ahead.
    ahead: Option<*const i8>,
    /// The next panel's share: its line for pair 0 and the bytes per pair (64: a line per
    /// pair, half the panel; 128: two, all of it).
    next: Option<(*const i8, usize)>,
}

impl Prefetch {
    /// Bytes of one input pair of a panel: two cache lines.
    const PAIR_BYTES: usize = PAIR_STRIDE * 2;

    /// The plan for pass `pass` of `passes` (rows) over the panel `weights` (`pairs` input
    /// pairs); `stream_next`: whether this pass may stream the next panel (not the first pass
    /// over the call's first panel, which nothing prefetched).
    fn plan(weights: &[u16], pairs: usize, pass: usize, passes: usize, stream_next: bool) -> Self {
        let own = weights.as_ptr().cast::<i8>();
        Prefetch {
            ahead: Some(own.wrapping_add(PREFETCH_BYTES)),
            next: if stream_next && passes > 1 {
                Self::next_share(weights, pairs, pass, passes)
            } else {
                None
            },
        }
    }

    /// The plan for quarter group `group` of `groups` of the AVX2 kernel's walk over a panel:
    /// the first group prefetches ahead, the later ones share out the next panel (its first
    /// group then finds the panel in L2).
    #[cfg(target_arch = "x86_64")]
    fn quarter_group(weights: &[u16], pairs: usize, group: usize, groups: usize) -> Self {
        if group == 0 {
            return Prefetch {
                ahead: Some(weights.as_ptr().cast::<i8>().wrapping_add(PREFETCH_BYTES)),
                next: None,
            };
        }
        Prefetch {
            ahead: None,
            next: Self::next_share(weights, pairs, group - 1, groups - 1),
        }
    }

    /// Part `part` of `parts`'s share of the next panel's `2 * pairs` lines (panels follow
    /// each other in memory): the first two parts take half each, a lone part all of them.
    fn next_share(
        weights: &[u16],
        pairs: usize,
        part: usize,
        parts: usize,
    ) -> Option<(*const i8, usize)> {
        let sharing = parts.min(2);
        (part < sharing).then(|| {
            let step = Self::PAIR_BYTES / sharing;
            let next_panel = weights
                .as_ptr()
                .cast::<i8>()
                .wrapping_add(weights.len() * 2);
            (next_panel.wrapping_add(part * pairs * step), step)
        })
    }

    /// Issues pair `p`'s prefetches: the next panel's into the second-level cache only (it
    /// must not evict this panel's lines, which the later passes read again). Addresses past
    /// the matrix are harmless: a prefetch never faults, hence `wrapping_add`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn pair(self, p: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        // SAFETY: prefetching is a hint; it reads nothing and never faults.
        self.lines(
            p,
            |line| unsafe { _mm_prefetch::<_MM_HINT_T0>(line) },
            |line| unsafe { _mm_prefetch::<_MM_HINT_T1>(line) },
        );
    }

    /// Pair `p`'s lines: two ahead in this panel to `ahead`, one or two of the next panel to
    /// `next` (closures, so that the kernels' loops see plain prefetches).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    #[inline(always)]
    fn lines(self, p: usize, mut ahead: impl FnMut(*const i8), mut next: impl FnMut(*const i8)) {
        if let Some(a) = self.ahead {
            let at = a.wrapping_add(p * Self::PAIR_BYTES);
            ahead(at);
            ahead(at.wrapping_add(64));
        }
        if let Some((n, step)) = self.next {
            let at = n.wrapping_add(p * step);
            next(at);
            if step > 64 {
                next(at.wrapping_add(64));
            }
        }
    }
}

/// A block of rows (f32 for the FMA chain, bf16 bits for the dot products) times one panel.
struct Tile<'a, X> {
    x: &'a [X],
    x_stride: usize,
    weights: &'a [u16],
    pairs: usize,
    prefetch: Prefetch,
    bias: Option<&'a [f32]>,
    out: *mut u16,
    out_stride: usize,
    columns: usize,
    rows: usize,
}

impl Tile<'_, f32> {
    /// The definition: the same FMAs in the same order as the SIMD kernel.
    fn scalar(&self) {
        for r in 0..self.rows {
            let x = &self.x[r * self.x_stride..];
            for c in 0..self.columns {
                let mut acc = self.bias.map_or(0.0, |b| b[c]);
                for p in 0..self.pairs {
                    let w = &self.weights[p * PAIR_STRIDE + c * 2..];
                    acc = x[2 * p].mul_add(bf16_to_f32(w[0]), acc);
                    acc = x[2 * p + 1].mul_add(bf16_to_f32(w[1]), acc);
                }
                // SAFETY: r < rows, c < columns: inside the tile (see Job::run).
                unsafe { *self.out.add(r * self.out_stride + c) = f32_to_bf16(acc) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Tile, PAIR_STRIDE};
    use crate::simd::{lanes, to_bf16};
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }

    /// Dispatches on the row count so each kernel keeps its accumulators in registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VL; `tile` must describe valid memory (Job::run).
    pub unsafe fn tile(tile: &Tile<'_, f32>) {
        match tile.rows {
            1 => kernel::<1>(tile),
            2 => kernel::<2>(tile),
            3 => kernel::<3>(tile),
            4 => kernel::<4>(tile),
            5 => kernel::<5>(tile),
            6 => kernel::<6>(tile),
            7 => kernel::<7>(tile),
            8 => kernel::<8>(tile),
            9 => kernel::<9>(tile),
            10 => kernel::<10>(tile),
            11 => kernel::<11>(tile),
            12 => kernel::<12>(tile),
            n => unreachable!("a pass has at most 12 rows, got {n}"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn kernel<const R: usize>(tile: &Tile<'_, f32>) {
        let mut acc = first_sums::<R>(tile.bias);
        let high_half = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let w = tile.weights.as_ptr();
        let x = tile.x.as_ptr();
        for p in 0..tile.pairs {
            let pair = w.add(p * PAIR_STRIDE);
            tile.prefetch.pair(p);
            let a = _mm512_loadu_si512(pair.cast());
            let b = _mm512_loadu_si512(pair.add(32).cast());
            // Lane c of `a` holds columns c's weights for inputs 2p (low) and 2p+1 (high).
            let even = [
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(a)),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b)),
            ];
            let odd = [
                _mm512_castsi512_ps(_mm512_and_si512(a, high_half)),
                _mm512_castsi512_ps(_mm512_and_si512(b, high_half)),
            ];
            for (r, row) in acc.iter_mut().enumerate() {
                let xr = x.add(r * tile.x_stride + 2 * p);
                let x0 = _mm512_set1_ps(*xr);
                let x1 = _mm512_set1_ps(*xr.add(1));
                for half in 0..2 {
                    row[half] = _mm512_fmadd_ps(x0, even[half], row[half]);
                    row[half] = _mm512_fmadd_ps(x1, odd[half], row[half]);
                }
            }
        }
        store_sums(&acc, tile);
    }

    /// Every row's two accumulators (a panel's 32 outputs) starting at the bias, or 0.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn first_sums<const R: usize>(bias: Option<&[f32]>) -> [[__m512; 2]; R] {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        if let Some(bias) = bias {
            let lo = _mm512_loadu_ps(bias.as_ptr());
            let hi = _mm512_loadu_ps(bias.as_ptr().add(16));
            for row in acc.iter_mut() {
                *row = [lo, hi];
            }
        }
        acc
    }

    /// Every row's sums rounded to bf16 into the tile's columns of `out`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn store_sums<const R: usize, X>(acc: &[[__m512; 2]; R], tile: &Tile<'_, X>) {
        for (r, row) in acc.iter().enumerate() {
            for (half, &v) in row.iter().enumerate() {
                let first = half * 16;
                if first >= tile.columns {
                    break;
                }
                let dst = tile.out.add(r * tile.out_stride + first);
                let packed = to_bf16(v);
                let valid = tile.columns - first;
                if valid >= 16 {
                    _mm256_storeu_si256(dst.cast(), packed);
                } else {
                    _mm256_mask_storeu_epi16(dst.cast(), lanes(valid), packed);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512bf16 {
    //! The AVX-512 kernel's panel walk with `vdpbf16ps`: one instruction multiplies a row's
    //! pair of inputs `(2p, 2p+1)` (one 32-bit lane, broadcast) by 16 outputs' weight pairs
    //! (the packed layout's lanes as they are) and adds both products, where the FMA chain
    //! converts the weights to f32 and spends two FMAs. Each output is `bias` (or 0), then per
    //! pair the product of input `2p+1`, then of input `2p`, each added and rounded as an f32
    //! FMA with denormal inputs and results flushed to zero (the instruction's definition,
    //! spelled out by the tests' `dot_product`): its own bits, the same for a row alone as in
    //! a tree.

    use super::avx512::{first_sums, store_sums};
    use super::{Tile, PAIR_STRIDE};
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        super::avx512::available() && std::arch::is_x86_feature_detected!("avx512bf16")
    }

    /// Dispatches on the row count so each kernel keeps its accumulators in registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VL and AVX512-BF16; `tile` must describe valid memory.
    pub unsafe fn tile(tile: &Tile<'_, u16>) {
        match tile.rows {
            1 => kernel::<1>(tile),
            2 => kernel::<2>(tile),
            3 => kernel::<3>(tile),
            4 => kernel::<4>(tile),
            5 => kernel::<5>(tile),
            6 => kernel::<6>(tile),
            7 => kernel::<7>(tile),
            8 => kernel::<8>(tile),
            n => unreachable!("a pass has at most 8 rows, got {n}"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn kernel<const R: usize>(tile: &Tile<'_, u16>) {
        let mut acc = first_sums::<R>(tile.bias);
        let w = tile.weights.as_ptr();
        let x = tile.x.as_ptr();
        for p in 0..tile.pairs {
            let pair = w.add(p * PAIR_STRIDE);
            tile.prefetch.pair(p);
            let weights: [__m512bh; 2] = [
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(pair.cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(pair.add(32).cast())),
            ];
            for (r, row) in acc.iter_mut().enumerate() {
                // The row's inputs 2p (low half) and 2p+1 (high half) in every lane.
                let inputs = x
                    .add(r * tile.x_stride + 2 * p)
                    .cast::<i32>()
                    .read_unaligned();
                let inputs = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(inputs));
                for half in 0..2 {
                    row[half] = _mm512_dpbf16_ps(row[half], inputs, weights[half]);
                }
            }
        }
        store_sums(&acc, tile);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX-512 kernel's FMA chain on 8 lanes. A panel's 32 outputs are four quarters of
    //! 8 (one register each); a pass multiplies `Q` quarters of `R` rows over every input pair,
    //! one accumulator per (quarter, row). Few rows take several quarters per pass so that
    //! enough independent FMA chains hide the FMA latency (one row alone would wait on each
    //! FMA); many rows take one quarter, keeping `R x Q <= 12` accumulators within AVX2's 16
    //! registers. The pass holding the first quarter streams the panel from memory; later
    //! passes find it in the cache and stream the next panel meanwhile
    //! ([`Prefetch::quarter_group`]). Each output is still `bias` then one FMA per input in
    //! input order: the scalar kernel's bits.

    use super::{Prefetch, Tile, PAIR_STRIDE, PANEL_COLUMNS};
    use crate::bf16::f32_to_bf16;
    use std::arch::x86_64::*;

    /// Outputs per register: 8 f32 lanes.
    const QUARTER: usize = 8;

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// Dispatches on the row count so each kernel keeps its accumulators in registers.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `tile` must describe valid memory (Job::run).
    pub unsafe fn tile(tile: &Tile<'_, f32>) {
        match tile.rows {
            1 => kernel::<1, 4>(tile),
            2 => kernel::<2, 4>(tile),
            3 => kernel::<3, 4>(tile),
            4 => kernel::<4, 2>(tile),
            5 => kernel::<5, 2>(tile),
            6 => kernel::<6, 2>(tile),
            7 => kernel::<7, 1>(tile),
            8 => kernel::<8, 1>(tile),
            9 => kernel::<9, 1>(tile),
            10 => kernel::<10, 1>(tile),
            11 => kernel::<11, 1>(tile),
            12 => kernel::<12, 1>(tile),
            n => unreachable!("a pass has at most 12 rows, got {n}"),
        }
    }

    /// `R` rows, `Q` quarters per pass. Quarters past the tile's columns (the last panel)
    /// are computed from the zero padding and not written.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn kernel<const R: usize, const Q: usize>(tile: &Tile<'_, f32>) {
        let high_half = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        let w = tile.weights.as_ptr();
        let x = tile.x.as_ptr();
        let columns = PANEL_COLUMNS.min(tile.columns);
        let groups = columns.div_ceil(QUARTER * Q);
        for first in (0..columns).step_by(QUARTER * Q) {
            let prefetch =
                Prefetch::quarter_group(tile.weights, tile.pairs, first / (QUARTER * Q), groups);
            let mut acc = [[_mm256_setzero_ps(); R]; Q];
            if let Some(bias) = tile.bias {
                // The bias is padded to whole panels (Job::run).
                for (q, acc_q) in acc.iter_mut().enumerate() {
                    *acc_q = [_mm256_loadu_ps(bias.as_ptr().add(first + q * QUARTER)); R];
                }
            }
            for p in 0..tile.pairs {
                let pair = w.add(p * PAIR_STRIDE);
                prefetch.pair(p);
                for (q, acc_q) in acc.iter_mut().enumerate() {
                    // Lane c: output first + 8q + c's weights for inputs 2p (low half) and
                    // 2p+1 (high half).
                    let lanes = _mm256_loadu_si256(pair.add((first + q * QUARTER) * 2).cast());
                    let even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lanes));
                    let odd = _mm256_castsi256_ps(_mm256_and_si256(lanes, high_half));
                    for (r, acc_r) in acc_q.iter_mut().enumerate() {
                        let xr = x.add(r * tile.x_stride + 2 * p);
                        *acc_r = _mm256_fmadd_ps(_mm256_set1_ps(*xr), even, *acc_r);
                        *acc_r = _mm256_fmadd_ps(_mm256_set1_ps(*xr.add(1)), odd, *acc_r);
                    }
                }
            }
            for (q, acc_q) in acc.iter().enumerate() {
                let start = first + q * QUARTER;
                if start >= columns {
                    break;
                }
                let valid = (columns - start).min(QUARTER);
                for (r, acc_r) in acc_q.iter().enumerate() {
                    let mut sums = [0f32; QUARTER];
                    _mm256_storeu_ps(sums.as_mut_ptr(), *acc_r);
                    let dst = tile.out.add(r * tile.out_stride + start);
                    for (c, &sum) in sums[..valid].iter().enumerate() {
                        *dst.add(c) = f32_to_bf16(sum);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod amx {
    //! Tile multiplication. Tiles: tmm0/tmm1 accumulate the first 16 rows' outputs 0-15 and
    //! 16-31 of a panel, tmm2/tmm3 the next 16 rows'; tmm4/tmm5 hold those rows' inputs of one
    //! block; tmm6/tmm7 the block's weights for outputs 0-15 and 16-31. The compiler never
    //! allocates tile registers, so they keep their values between the `asm!` blocks.

    use super::{Job, PAIRS_PER_BLOCK, PAIR_STRIDE, PANEL_COLUMNS};
    use crate::simd::{lanes, to_bf16};
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Rows of one tile.
    const TILE_ROWS: usize = 16;
    /// Bytes of one tile row: 16 pairs of inputs, or 16 f32 outputs.
    const TILE_ROW_BYTES: usize = 64;
    /// Bytes of one block of weights (both halves of a panel): read as two tiles.
    const BLOCK_BYTES: usize = PAIRS_PER_BLOCK * PAIR_STRIDE * 2;
    /// How far ahead of the tile loads the kernel prefetches.
    const PREFETCH_BYTES: usize = 2 * BLOCK_BYTES;

    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            super::avx512::available() && cpu_has_amx_bf16() && request_tile_permission()
        })
    }

    fn cpu_has_amx_bf16() -> bool {
        // CPUID leaf 7, subleaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
        #[allow(unused_unsafe)] // __cpuid is safe on newer toolchains
        let (max_leaf, edx) = unsafe {
            let max_leaf = __cpuid(0).eax;
            (
                max_leaf,
                if max_leaf >= 7 {
                    __cpuid_count(7, 0).edx
                } else {
                    0
                },
            )
        };
        max_leaf >= 7 && edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    }

    /// Linux hands tile data out per process on request (`ARCH_REQ_XCOMP_PERM`); without it
    /// the first tile instruction is SIGILL. Refused on kernels older than 5.16.
    #[cfg(target_os = "linux")]
    fn request_tile_permission() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain syscall with integer arguments.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tile_permission() -> bool {
        false
    }

    /// `ldtilecfg`'s operand (palette 1).
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        bytes_per_row: [u16; 16],
        rows: [u8; 16],
    }

    impl TileConfig {
        /// Tiles for `first` rows (1..=16) and `second` more (0..=16; 0 leaves tmm2, tmm3 and
        /// tmm5 unconfigured).
        fn new(first: usize, second: usize) -> Self {
            let mut config = TileConfig {
                palette: 1,
                start_row: 0,
                reserved: [0; 14],
                bytes_per_row: [0; 16],
                rows: [0; 16],
            };
            for (tile, rows) in [
                (0, first),
                (1, first),
                (4, first),
                (2, second),
                (3, second),
                (5, second),
                (6, PAIRS_PER_BLOCK),
                (7, PAIRS_PER_BLOCK),
            ] {
                if rows > 0 {
                    config.rows[tile] = rows as u8;
                    config.bytes_per_row[tile] = TILE_ROW_BYTES as u16;
                }
            }
            config
        }
    }

    /// Every row of `job` times `panels`, in passes of up to 32 rows; `x` holds the rows as
    /// bf16, `stride` elements apart, padded to whole blocks.
    ///
    /// # Safety
    /// AMX must be available (`available()`); `job`'s lengths must have been checked.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn run(job: &Job<'_>, x: &[u16], stride: usize, panels: std::ops::Range<usize>) {
        let m = job.matrix;
        let blocks = m.panel_pairs / PAIRS_PER_BLOCK;
        let passes = job.rows.div_ceil(super::AMX_ROWS_PER_PASS);
        // Accumulators stored as 32 rows x 32 f32 (row stride 128 bytes).
        let mut sums = [[0f32; PANEL_COLUMNS]; 2 * TILE_ROWS];
        let mut row = 0;
        for pass in 0..passes {
            let count = job.rows / passes + usize::from(pass < job.rows % passes);
            let first = count.min(TILE_ROWS);
            let second = count - first;
            let config = TileConfig::new(first, second);
            asm!("ldtilecfg [{0}]", in(reg) &config, options(nostack, readonly));
            let rows_ptr = x.as_ptr().add(row * stride).cast::<u8>();
            let row_bytes = stride * 2;
            for panel in panels.clone() {
                let weights = m.panel_lines(panel).as_ptr().cast::<u8>();
                asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
                if second > 0 {
                    asm!("tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
                }
                for block in 0..blocks {
                    let w = weights.add(block * BLOCK_BYTES);
                    for line in (0..BLOCK_BYTES).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(
                            w.cast::<i8>().wrapping_add(PREFETCH_BYTES + line),
                        );
                    }
                    let a = rows_ptr.add(block * TILE_ROW_BYTES);
                    asm!(
                        "tileloadd tmm6, [{w} + {ws}*1]",
                        "tileloadd tmm7, [{w2} + {ws}*1]",
                        "tileloadd tmm4, [{a} + {xs}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        w = in(reg) w,
                        w2 = in(reg) w.add(TILE_ROW_BYTES),
                        ws = in(reg) PAIR_STRIDE * 2,
                        a = in(reg) a,
                        xs = in(reg) row_bytes,
                        options(nostack, readonly),
                    );
                    if second > 0 {
                        asm!(
                            "tileloadd tmm5, [{a} + {xs}*1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            a = in(reg) a.add(TILE_ROWS * row_bytes),
                            xs = in(reg) row_bytes,
                            options(nostack, readonly),
                        );
                    }
                }
                let sums_ptr = sums.as_mut_ptr().cast::<u8>();
                let sums_stride = PANEL_COLUMNS * 4;
                asm!(
                    "tilestored [{s} + {ss}*1], tmm0",
                    "tilestored [{s2} + {ss}*1], tmm1",
                    s = in(reg) sums_ptr,
                    s2 = in(reg) sums_ptr.add(TILE_ROW_BYTES),
                    ss = in(reg) sums_stride,
                    options(nostack),
                );
                if second > 0 {
                    let lower = sums_ptr.add(TILE_ROWS * sums_stride);
                    asm!(
                        "tilestored [{s} + {ss}*1], tmm2",
                        "tilestored [{s2} + {ss}*1], tmm3",
                        s = in(reg) lower,
                        s2 = in(reg) lower.add(TILE_ROW_BYTES),
                        ss = in(reg) sums_stride,
                        options(nostack),
                    );
                }
                let first_column = panel * PANEL_COLUMNS;
                let columns = (m.out_features - first_column).min(PANEL_COLUMNS);
                for (r, sum) in sums[..count].iter().enumerate() {
                    for half in 0..2 {
                        let start = half * 16;
                        if start >= columns {
                            break;
                        }
                        let mut v = _mm512_loadu_ps(sum.as_ptr().add(start));
                        if let Some(bias) = job.bias {
                            let b = _mm512_loadu_ps(bias.as_ptr().add(first_column + start));
                            v = _mm512_add_ps(v, b);
                        }
                        // SAFETY: row + r < rows, the columns are this panel's (checked lengths).
                        let dst = job
                            .out
                            .0
                            .add((row + r) * m.out_features + first_column + start);
                        let valid = columns - start;
                        if valid >= 16 {
                            _mm256_storeu_si256(dst.cast(), to_bf16(v));
                        } else {
                            _mm256_mask_storeu_epi16(dst.cast(), lanes(valid), to_bf16(v));
                        }
                    }
                }
            }
            row += count;
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// A rayon pool of `threads` workers, built once per size (a matmul takes ~100 us: building
/// a pool per call would cost more than it saves).
pub(crate) fn pool(threads: usize) -> Arc<rayon::ThreadPool> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    pools
        .entry(threads)
        .or_insert_with(|| {
            Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("dart-matmul-{i}"))
                    .build()
                    .expect("a rayon pool (threads could not be spawned)"),
            )
        })
        .clone()
}

fn lines_as_u16(lines: &[Line]) -> &[u16] {
    // SAFETY: Line is repr(C) [u16; 32] with no padding (64 bytes, align 64).
    unsafe { std::slice::from_raw_parts(lines.as_ptr().cast(), lines.len() * 32) }
}

fn lines_as_u16_mut(lines: &mut [Line]) -> &mut [u16] {
    // SAFETY: as in lines_as_u16.
    unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast(), lines.len() * 32) }
}

fn positive(what: &'static str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(KernelError::Dimension {
            what,
            max: usize::MAX,
            got: 0,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// bf16 bits of small values (|v| <= 2, a few hundred distinct), so sums stay exact-ish.
    fn bf16_values(len: usize) -> impl Strategy<Value = Vec<u16>> {
        proptest::collection::vec(-256i32..256, len).prop_map(|v| {
            v.into_iter()
                .map(|i| f32_to_bf16(i as f32 / 128.0))
                .collect()
        })
    }

    /// The product in f64 from the unpacked weight.
    fn reference(
        w: &[u16],
        n: usize,
        k: usize,
        x: &[u16],
        rows: usize,
        bias: Option<&[u16]>,
    ) -> Vec<f64> {
        let mut out = vec![0f64; rows * n];
        for r in 0..rows {
            for c in 0..n {
                let mut acc = bias.map_or(0.0, |b| bf16_to_f32(b[c]) as f64);
                for i in 0..k {
                    acc += bf16_to_f32(x[r * k + i]) as f64 * bf16_to_f32(w[c * k + i]) as f64;
                }
                out[r * n + c] = acc;
            }
        }
        out
    }

    /// `backend`'s product of `case` on `threads` threads has the scalar kernel's bits.
    fn fma_kernel_equals_scalar(
        backend: Backend,
        (n, k, rows, w, x, bias): Case,
        threads: usize,
    ) -> std::result::Result<(), TestCaseError> {
        let m = PackedMatrix::pack(&w, n, k).unwrap();
        let mut want = vec![0u16; rows * n];
        m.matmul_with(Backend::Scalar, &x, rows, bias.as_deref(), &mut want, 1)
            .unwrap();
        let mut got = vec![0xFFFFu16; rows * n];
        m.matmul_with(backend, &x, rows, bias.as_deref(), &mut got, threads)
            .unwrap();
        prop_assert_eq!(got, want);
        Ok(())
    }

    /// (out_features, in_features, rows, weight, x, bias)
    type Case = (usize, usize, usize, Vec<u16>, Vec<u16>, Option<Vec<u16>>);

    fn case() -> impl Strategy<Value = Case> {
        (1usize..70, 1usize..40, 1usize..30).prop_flat_map(|(n, k, rows)| {
            (
                Just(n),
                Just(k),
                Just(rows),
                bf16_values(n * k),
                bf16_values(rows * k),
                proptest::option::of(bf16_values(n)),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Packing keeps every weight where the kernel reads it: the scalar kernel over the
        /// packed layout equals the f64 product of the original matrix (exact here: the
        /// values are multiples of 2^-7 with sums well inside f32's precision), rounded once.
        #[test]
        fn scalar_is_the_product((n, k, rows, w, x, bias) in case()) {
            let m = PackedMatrix::pack(&w, n, k).unwrap();
            let mut out = vec![0u16; rows * n];
            m.matmul_with(Backend::Scalar, &x, rows, bias.as_deref(), &mut out, 1).unwrap();
            let want = reference(&w, n, k, &x, rows, bias.as_deref());
            for (got, want) in out.iter().zip(&want) {
                prop_assert_eq!(*got, f32_to_bf16(*want as f32));
            }
        }

        /// The SIMD kernel gives the scalar kernel's bits, on any number of threads, on
        /// general values (where a different summation order would change the bits).
        #[test]
        #[cfg_attr(not(dart_cpu_avx512), ignore = "needs AVX-512F/BW/VL, which this CPU lacks")]
        fn simd_equals_scalar(case in general_case(), threads in 1usize..4) {
            assert!(Backend::avx512_available(), "built for AVX-512 but it does not run here");
            fma_kernel_equals_scalar(Backend::Avx512, case, threads)?;
        }

        /// The AVX2 kernel gives the scalar kernel's bits too (quarters of panels, rows
        /// past one pass of 12, padded last panels), on any number of threads.
        #[test]
        #[cfg_attr(not(dart_cpu_avx2), ignore = "needs AVX2 and FMA, which this CPU lacks")]
        fn avx2_equals_scalar(case in general_case(), threads in 1usize..4) {
            assert!(Backend::avx2_available(), "built for AVX2 and FMA but they do not run here");
            fma_kernel_equals_scalar(Backend::Avx2, case, threads)?;
        }

        /// The AVX512-BF16 kernel computes `vdpbf16ps`'s definition exactly (`dot_product`),
        /// on any number of threads and row counts past one pass, on general values.
        #[test]
        #[cfg_attr(not(dart_cpu_avx512bf16), ignore = "needs AVX512-BF16, which this CPU lacks")]
        fn avx512_bf16_is_the_dot_product(
            (n, k, rows, w, x, bias) in general_case(),
            threads in 1usize..4,
        ) {
            assert!(Backend::avx512_bf16_available(), "built for AVX512-BF16 but it does not run here");
            let m = PackedMatrix::pack(&w, n, k).unwrap();
            let mut got = vec![0xFFFFu16; rows * n];
            m.matmul_with(Backend::Avx512Bf16, &x, rows, bias.as_deref(), &mut got, threads)
                .unwrap();
            prop_assert_eq!(got, dot_product(&w, n, k, &x, rows, bias.as_deref()));
        }

        /// The same where flushing to zero shows: denormal inputs, and magnitudes (2^-77 to
        /// 2^-47) whose products and sums straddle f32's smallest normal, 2^-126.
        #[test]
        #[cfg_attr(not(dart_cpu_avx512bf16), ignore = "needs AVX512-BF16, which this CPU lacks")]
        fn avx512_bf16_flushes_denormals_as_defined(
            (n, k, rows) in (1usize..40, 1usize..60, 1usize..14),
            seed in any::<u64>(),
        ) {
            let mut state = seed | 1;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let sign = (state & 1) as u16;
                let exponent = match (state >> 1) % 8 {
                    0 => 0, // a denormal (or zero)
                    _ => 50 + ((state >> 4) % 31) as u16, // 2^-77..2^-47
                };
                (sign << 15) | (exponent << 7) | ((state >> 40) & 0x7F) as u16
            };
            let w: Vec<u16> = (0..n * k).map(|_| next()).collect();
            let x: Vec<u16> = (0..rows * k).map(|_| next()).collect();
            let m = PackedMatrix::pack(&w, n, k).unwrap();
            let mut got = vec![0u16; rows * n];
            m.matmul_with(Backend::Avx512Bf16, &x, rows, None, &mut got, 1).unwrap();
            prop_assert_eq!(got, dot_product(&w, n, k, &x, rows, None));
        }

        /// The AMX kernel is the product within f32 accumulation error, gives the same bits
        /// on any number of threads, and a row's bits do not depend on the rows beside it
        /// (row counts past one pass of 32 included), on general values.
        #[test]
        #[cfg_attr(not(dart_cpu_amx), ignore = "needs AMX-BF16, which this CPU lacks")]
        fn amx_is_the_product_row_by_row(
            (n, k, rows, w, x, bias) in general_case(),
            threads in 1usize..4,
            pick in any::<proptest::sample::Index>(),
        ) {
            assert!(
                Backend::amx_available(),
                "built on a CPU with AMX-BF16, but the kernel does not run (the OS refused tile data?)"
            );
            let x = &x[..];
            let m = PackedMatrix::pack(&w, n, k).unwrap();
            let mut got = vec![0xFFFFu16; rows * n];
            m.matmul_with(Backend::Amx, x, rows, bias.as_deref(), &mut got, threads).unwrap();
            let want = reference(&w, n, k, x, rows, bias.as_deref());
            let scale = magnitudes(&w, n, k, x, rows, bias.as_deref());
            for ((got, want), scale) in got.iter().zip(&want).zip(&scale) {
                prop_assert!(
                    close_to_f64(*got, *want, *scale, k),
                    "{} vs {want}",
                    bf16_to_f32(*got)
                );
            }
            let mut alone = vec![0u16; rows * n];
            m.matmul_with(Backend::Amx, x, rows, bias.as_deref(), &mut alone, 1).unwrap();
            prop_assert_eq!(&alone, &got);
            let r = pick.index(rows);
            let mut one = vec![0u16; n];
            m.matmul_with(Backend::Amx, &x[r * k..(r + 1) * k], 1, bias.as_deref(), &mut one, 1)
                .unwrap();
            prop_assert_eq!(&got[r * n..(r + 1) * n], &one[..]);
        }

        /// A row's result does not depend on the rows multiplied with it, on every backend
        /// this CPU runs, on general values (a summation order that depends on the row count
        /// changes the bits).
        #[test]
        fn rows_are_independent(
            (n, k, rows, w, x, bias) in general_case(),
            pick in any::<proptest::sample::Index>(),
            threads in 1usize..4,
        ) {
            let m = PackedMatrix::pack(&w, n, k).unwrap();
            let r = pick.index(rows);
            for backend in runnable_backends() {
                let mut all = vec![0u16; rows * n];
                m.matmul_with(backend, &x, rows, bias.as_deref(), &mut all, threads).unwrap();
                let mut one = vec![0u16; n];
                m.matmul_with(backend, &x[r * k..(r + 1) * k], 1, bias.as_deref(), &mut one, 1)
                    .unwrap();
                prop_assert_eq!(&all[r * n..(r + 1) * n], &one[..], "{}", backend.name());
            }
        }

        /// The scalar kernel on general values: the product within f32 accumulation error.
        #[test]
        fn scalar_is_the_product_on_general_values((n, k, rows, w, x, bias) in general_case()) {
            let m = PackedMatrix::pack(&w, n, k).unwrap();
            let mut out = vec![0u16; rows * n];
            m.matmul_with(Backend::Scalar, &x, rows, bias.as_deref(), &mut out, 1).unwrap();
            let want = reference(&w, n, k, &x, rows, bias.as_deref());
            let scale = magnitudes(&w, n, k, &x, rows, bias.as_deref());
            for ((got, want), scale) in out.iter().zip(&want).zip(&scale) {
                prop_assert!(
                    close_to_f64(*got, *want, *scale, k),
                    "{} vs {want}",
                    bf16_to_f32(*got)
                );
            }
        }
    }

    /// `vdpbf16ps`'s definition, one output at a time from the unpacked weight: per input
    /// pair, `acc += x[2p+1] * w[2p+1]`, then `acc += x[2p] * w[2p]`, each an f32 FMA with
    /// denormal inputs read as zero and a denormal result flushed to zero (signs kept);
    /// rounded to bf16 once at the end.
    fn dot_product(
        w: &[u16],
        n: usize,
        k: usize,
        x: &[u16],
        rows: usize,
        bias: Option<&[u16]>,
    ) -> Vec<u16> {
        let flush = |v: f32| {
            if v.is_subnormal() {
                0.0f32.copysign(v)
            } else {
                v
            }
        };
        // An odd `k`'s last pair is padded with +0 (which turns an accumulated -0 into +0).
        let input = |row: &[u16], i: usize| row.get(i).map_or(0.0, |&b| flush(bf16_to_f32(b)));
        let mut out = vec![0u16; rows * n];
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            for c in 0..n {
                let wc = &w[c * k..(c + 1) * k];
                let mut acc = bias.map_or(0.0, |b| bf16_to_f32(b[c]));
                for p in 0..k.div_ceil(2) {
                    for i in [2 * p + 1, 2 * p] {
                        acc = flush(input(xr, i).mul_add(input(wc, i), acc));
                    }
                }
                out[r * n + c] = f32_to_bf16(acc);
            }
        }
        out
    }

    /// Backends this CPU runs (the scalar one everywhere).
    fn runnable_backends() -> Vec<Backend> {
        let mut out = vec![Backend::Scalar];
        if Backend::avx2_available() {
            out.push(Backend::Avx2);
        }
        if Backend::avx512_available() {
            out.push(Backend::Avx512);
        }
        if Backend::avx512_bf16_available() {
            out.push(Backend::Avx512Bf16);
        }
        if Backend::amx_available() {
            out.push(Backend::Amx);
        }
        out
    }

    /// General bf16 values: random sign, all 7 mantissa bits random, magnitudes 2^-6..2^2.
    /// Their products need 16 significant bits and sums of them round in f32 (unlike the
    /// multiples of 2^-7 in `bf16_values`).
    fn general_bf16(len: usize) -> impl Strategy<Value = Vec<u16>> {
        proptest::collection::vec(general_value(121..=129), len)
    }

    fn general_value(exponents: std::ops::RangeInclusive<u16>) -> impl Strategy<Value = u16> {
        (any::<bool>(), exponents, 0u16..128).prop_map(|(negative, exponent, mantissa)| {
            (u16::from(negative) << 15) | (exponent << 7) | mantissa
        })
    }

    /// As `case`, with general values, `k` up to 200 (long sums, several panels), up to 69
    /// rows (past one AMX pass of 32) and, as
    /// activations with outliers have, a cancelling pair: inputs `i` and `j` of every row
    /// are the same large value (2^16..2^22) and every weight row has `w[j] = -w[i]`. The two
    /// products cancel exactly, but in f32 each swallows the low bits of the partial sum it
    /// meets, so a kernel that sums in another order (for one row, for the rows of a tree)
    /// gives other bits even after rounding to bf16.
    fn general_case() -> impl Strategy<Value = Case> {
        (1usize..70, 2usize..200, 1usize..70).prop_flat_map(|(n, k, rows)| {
            (
                Just(n),
                Just(k),
                Just(rows),
                general_bf16(n * k),
                general_bf16(rows * k),
                proptest::option::of(general_bf16(n)),
                (0..k, 0..k - 1),
                proptest::collection::vec(general_value(143..=149), rows),
            )
                .prop_map(|(n, k, rows, mut w, mut x, bias, (i, j), large)| {
                    let j = if j >= i { j + 1 } else { j };
                    for (r, &big) in large.iter().enumerate() {
                        x[r * k + i] = big;
                        x[r * k + j] = big;
                    }
                    for c in 0..n {
                        w[c * k + j] = w[c * k + i] ^ 0x8000;
                    }
                    (n, k, rows, w, x, bias)
                })
        })
    }

    /// `got` (bf16) is the f64 product `want` up to bf16 rounding plus f32 accumulation
    /// error: at most `k + 1` roundings of partial sums bounded by `magnitude`, the sum of
    /// the terms' absolute values (`reference` of |w| and |x|).
    fn close_to_f64(got: u16, want: f64, magnitude: f64, k: usize) -> bool {
        let got = bf16_to_f32(got) as f64;
        let accumulation = (k as f64 + 2.0) * 2f64.powi(-24) * magnitude;
        (got - want).abs() <= (want.abs() + accumulation) * 2f64.powi(-8) + accumulation
    }

    /// `reference` of the absolute values: the bound `close_to_f64` scales its error by.
    fn magnitudes(
        w: &[u16],
        n: usize,
        k: usize,
        x: &[u16],
        rows: usize,
        bias: Option<&[u16]>,
    ) -> Vec<f64> {
        let abs = |v: &[u16]| v.iter().map(|b| b & 0x7FFF).collect::<Vec<u16>>();
        let bias = bias.map(abs);
        reference(&abs(w), n, k, &abs(x), rows, bias.as_deref())
    }

    /// Pseudo-random bf16 values in (-0.1, 0.1) (xorshift from `seed`).
    fn general_values(seed: u32) -> impl Iterator<Item = u16> {
        let mut state = seed;
        std::iter::repeat_with(move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            f32_to_bf16((state as f32 / u32::MAX as f32 - 0.5) * 0.2)
        })
    }

    #[test]
    fn general_values_match_f64_within_bf16_rounding() {
        // Pseudo-random values of every magnitude class a model has, a k past several panels.
        let (n, k, rows) = (100, 1001, 13);
        let mut values = general_values(0x9E37_79B9);
        let w: Vec<u16> = values.by_ref().take(n * k).collect();
        let x: Vec<u16> = values.by_ref().take(rows * k).collect();
        let m = PackedMatrix::pack(&w, n, k).unwrap();
        let mut out = vec![0u16; rows * n];
        m.matmul(&x, rows, None, &mut out, 2).unwrap();
        let want = reference(&w, n, k, &x, rows, None);
        for (got, want) in out.iter().zip(&want) {
            let got = bf16_to_f32(*got) as f64;
            assert!(
                (got - want).abs() <= want.abs() * 2f64.powi(-8) + 1e-6,
                "{got} vs {want}"
            );
        }
    }

    #[test]
    #[cfg_attr(not(dart_cpu_amx), ignore = "needs AMX-BF16, which this CPU lacks")]
    fn amx_rows_are_independent_on_general_values() {
        // Rounding shows here (unlike the exact small values above): tree rows must still be
        // bit-identical to the row alone, and close to the f64 product.
        assert!(
            Backend::amx_available(),
            "built on a CPU with AMX-BF16, but the kernel does not run (the OS refused tile data?)"
        );
        let (n, k, rows) = (70, 1001, 45);
        let mut values = general_values(0x2545_F491);
        let w: Vec<u16> = values.by_ref().take(n * k).collect();
        let x: Vec<u16> = values.by_ref().take(rows * k).collect();
        let bias: Vec<u16> = values.by_ref().take(n).collect();
        let m = PackedMatrix::pack(&w, n, k).unwrap();
        let mut all = vec![0u16; rows * n];
        m.matmul_with(Backend::Amx, &x, rows, Some(&bias), &mut all, 2)
            .unwrap();
        let want = reference(&w, n, k, &x, rows, Some(&bias));
        for r in 0..rows {
            let mut one = vec![0u16; n];
            m.matmul_with(
                Backend::Amx,
                &x[r * k..(r + 1) * k],
                1,
                Some(&bias),
                &mut one,
                1,
            )
            .unwrap();
            assert_eq!(&all[r * n..(r + 1) * n], &one[..], "row {r}");
            for (got, want) in one.iter().zip(&want[r * n..(r + 1) * n]) {
                let got = bf16_to_f32(*got) as f64;
                assert!(
                    (got - want).abs() <= want.abs() * 2f64.powi(-8) + 1e-5,
                    "{got} vs {want}"
                );
            }
        }
    }

    /// The next panel's lines (as offsets from its start) that `plans` prefetch over
    /// `pairs` input pairs, sorted, after checking each plan's lines ahead.
    fn next_panel_lines(plans: &[Prefetch], weights: &[u16], pairs: usize) -> Vec<usize> {
        let own = weights.as_ptr() as usize;
        let next_panel = own + weights.len() * 2;
        let mut lines = Vec::new();
        for plan in plans {
            for p in 0..pairs {
                let mut ahead = Vec::new();
                plan.lines(
                    p,
                    |line| ahead.push(line as usize),
                    |line| lines.push(line as usize - next_panel),
                );
                if !ahead.is_empty() {
                    let at = own + PREFETCH_BYTES + p * 128;
                    assert_eq!(ahead, [at, at + 64]);
                }
            }
        }
        lines.sort_unstable();
        lines
    }

    #[test]
    fn passes_stream_every_line_of_the_next_panel_once() {
        // A panel of 48 input pairs (whole blocks), 45 of them used.
        let weights = vec![0u16; 48 * PAIR_STRIDE];
        let pairs = 45;
        let every: Vec<usize> = (0..2 * pairs).map(|i| i * 64).collect();
        for passes in 2..6 {
            let plans: Vec<Prefetch> = (0..passes)
                .map(|pass| Prefetch::plan(&weights, pairs, pass, passes, true))
                .collect();
            assert!(plans.iter().all(|plan| plan.ahead.is_some()));
            assert_eq!(
                next_panel_lines(&plans, &weights, pairs),
                every,
                "{passes} passes"
            );
        }
        // The AVX2 kernel's quarter groups: the first prefetches ahead only, the later ones
        // the next panel.
        #[cfg(target_arch = "x86_64")]
        for groups in 2..5 {
            let plans: Vec<Prefetch> = (0..groups)
                .map(|group| Prefetch::quarter_group(&weights, pairs, group, groups))
                .collect();
            assert!(plans[0].ahead.is_some() && plans[0].next.is_none());
            assert_eq!(
                next_panel_lines(&plans, &weights, pairs),
                every,
                "{groups} groups"
            );
        }
        // One pass, or a pass told not to stream (the call's first panel, the FMA kernels):
        // only the lines ahead.
        for plan in [
            Prefetch::plan(&weights, pairs, 0, 1, true),
            Prefetch::plan(&weights, pairs, 1, 2, false),
        ] {
            assert_eq!(
                next_panel_lines(&[plan], &weights, pairs),
                Vec::<usize>::new()
            );
        }
    }

    #[test]
    fn backend_names_round_trip() {
        for b in Backend::ALL {
            assert_eq!(Backend::from_name(b.name()), Some(b));
        }
        assert_eq!(Backend::from_name("gpu"), None);
        assert_ne!(Backend::best(), Backend::Auto);
    }

    #[test]
    fn max_isa_names_a_backend_or_is_an_error() {
        let parse = |v: Option<&str>| Backend::parse_max_isa(v.map(str::to_owned));
        assert_eq!(parse(None).unwrap(), None);
        assert_eq!(parse(Some(" ")).unwrap(), None);
        assert_eq!(parse(Some("AVX2")).unwrap(), Some(Backend::Avx2));
        assert_eq!(parse(Some("scalar\n")).unwrap(), Some(Backend::Scalar));
        for bad in ["auto", "avx-512", "sse4"] {
            let err = parse(Some(bad)).unwrap_err().to_string();
            assert!(err.contains(bad) && err.contains("avx512"), "{err}");
        }
    }

    #[test]
    fn nan_and_infinity_propagate() {
        let w = vec![f32_to_bf16(1.0); 4];
        let m = PackedMatrix::pack(&w, 2, 2).unwrap();
        let mut out = vec![0u16; 2];
        m.matmul(&[f32_to_bf16(f32::NAN), 0], 1, None, &mut out, 1)
            .unwrap();
        assert_eq!(out, vec![0x7FC0, 0x7FC0]);
        m.matmul(&[f32_to_bf16(f32::INFINITY), 0], 1, None, &mut out, 1)
            .unwrap();
        assert_eq!(out, vec![0x7F80, 0x7F80]);
    }

    #[test]
    fn wrong_shapes_are_errors() {
        let w = vec![0u16; 6];
        assert_eq!(
            PackedMatrix::pack(&w, 2, 4).unwrap_err(),
            KernelError::Length {
                what: "weight",
                expected: 8,
                got: 6
            }
        );
        assert!(matches!(
            PackedMatrix::pack(&[], 0, 3),
            Err(KernelError::Dimension {
                what: "out_features",
                ..
            })
        ));
        let m = PackedMatrix::pack(&w, 2, 3).unwrap();
        let mut out = vec![0u16; 2];
        assert_eq!(
            m.matmul(&[0; 4], 1, None, &mut out, 1).unwrap_err(),
            KernelError::Length {
                what: "x",
                expected: 3,
                got: 4
            }
        );
        assert_eq!(
            m.matmul(&[0; 3], 1, Some(&[0; 3]), &mut out, 1)
                .unwrap_err(),
            KernelError::Length {
                what: "bias",
                expected: 2,
                got: 3
            }
        );
        assert!(matches!(
            m.matmul(&[], 0, None, &mut [], 1),
            Err(KernelError::Dimension { what: "rows", .. })
        ));
    }
}
