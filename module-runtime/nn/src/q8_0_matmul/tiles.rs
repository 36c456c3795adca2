//! The weight in the kernels' own layout: [`Tiles`] of 16 output rows by one block of 32 inputs,
//! for `q8_0` and `q4_0` weights, which hold every byte of the weight (so they replace it:
//! [`QuantizedLayout`]).

use candle_core::quantized::{GgmlDType, QTensor};
use module_core::QuantizedLayout;

use super::{BLOCK, ROWS};

/// 64 bytes, aligned for whole-register loads: four bytes of each of the 16 rows of a tile.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Quad(pub(super) [u8; 64]);

/// How a block's 32 weights of one row are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
    /// One byte per weight, plus 128 (unsigned, as `vpdpbusd` takes them): 8 quads per block,
    /// quad `g` holding inputs `4g..4g+4`.
    Q8,
    /// ggml's `q4_0` nibbles as they are: 4 quads per block, quad `g` holding the row's bytes
    /// `4g..4g+4` of the block, whose low nibbles are inputs `4g..4g+4` and high nibbles inputs
    /// `16 + 4g..16 + 4g + 4`, each weight its nibble minus 8.
    Q4,
}

impl Format {
    /// Quads per tile and block.
    pub(super) fn quads(self) -> usize {
        match self {
            Format::Q8 => 8,
            Format::Q4 => 4,
        }
    }

    /// ggml's bytes per block of one row: the float16 scale, then the weights.
    fn block_bytes(self) -> usize {
        2 + self.quads() * 4
    }

    /// The byte stored for ggml's byte `v` (and back: [`ggml`](Self::ggml)).
    fn stored(self, v: u8) -> u8 {
        match self {
            Format::Q8 => v.wrapping_add(128),
            Format::Q4 => v,
        }
    }

    /// ggml's byte for the stored byte `v`.
    fn ggml(self, v: u8) -> u8 {
        match self {
            Format::Q8 => v.wrapping_sub(128),
            Format::Q4 => v,
        }
    }
}

/// A `q8_0` or `q4_0` weight `[n, k]` in tiles of 16 rows by one block (see the module's docs).
pub(crate) struct Tiles {
    pub(super) format: Format,
    pub(super) n: usize,
    pub(super) k: usize,
    /// Per tile (row tile major, then block): [`Format::quads`] quads, each the same 4 bytes of
    /// the block for rows 0..16, row after row.
    pub(super) quads: Vec<Quad>,
    /// Per tile and block: the 16 rows' scales (float16 bits; 0 for the rows that pad the last
    /// tile).
    pub(super) scales: Vec<[u16; ROWS]>,
}

impl Tiles {
    /// The tiles of `w`, or `None` when it is not a CPU `q8_0` or `q4_0` matrix.
    pub(super) fn new(w: &QTensor) -> Option<Self> {
        let format = match w.dtype() {
            GgmlDType::Q8_0 => Format::Q8,
            GgmlDType::Q4_0 => Format::Q4,
            _ => return None,
        };
        if !w.device().is_cpu() {
            return None;
        }
        let (n, k) = w.shape().dims2().ok()?;
        let data = w.data().ok()?;
        let (nb, qpb, bytes) = (k / BLOCK, format.quads(), format.block_bytes());
        if k % BLOCK != 0 || data.len() != n * nb * bytes {
            return None;
        }
        let tiles = n.div_ceil(ROWS);
        // Padding rows: weights of zero (128 in `q8_0`'s unsigned bytes, nibbles of 8), scale 0.
        let pad = match format {
            Format::Q8 => 128,
            Format::Q4 => 0x88,
        };
        let mut quads = vec![Quad([pad; 64]); tiles * nb * qpb];
        let mut scales = vec![[0u16; ROWS]; tiles * nb];
        for row in 0..n {
            let (t, r) = (row / ROWS, row % ROWS);
            for b in 0..nb {
                let block = &data[(row * nb + b) * bytes..][..bytes];
                scales[t * nb + b][r] = u16::from_le_bytes([block[0], block[1]]);
                for (g, four) in block[2..].chunks_exact(4).enumerate() {
                    let quad = &mut quads[(t * nb + b) * qpb + g].0[r * 4..r * 4 + 4];
                    for (q, v) in quad.iter_mut().zip(four) {
                        *q = format.stored(*v);
                    }
                }
            }
        }
        Some(Self {
            format,
            n,
            k,
            quads,
            scales,
        })
    }

    /// Tile `t`'s quads and scales.
    pub(super) fn tile(&self, t: usize) -> (&[Quad], &[[u16; ROWS]]) {
        let (nb, qpb) = (self.k / BLOCK, self.format.quads());
        (
            &self.quads[t * nb * qpb..(t + 1) * nb * qpb],
            &self.scales[t * nb..(t + 1) * nb],
        )
    }
}

/// The tiles hold every byte of the weight (regrouped; `q8_0`'s bytes plus 128): once they are
/// made, the weight's own bytes are dropped and its rows come back from here.
impl QuantizedLayout for Tiles {
    fn holds_weight(&self) -> bool {
        true
    }

    fn row_bytes(&self, rows: &[usize]) -> Vec<u8> {
        let (nb, qpb) = (self.k / BLOCK, self.format.quads());
        let mut bytes = Vec::with_capacity(rows.len() * nb * self.format.block_bytes());
        for &row in rows {
            let (t, r) = (row / ROWS, row % ROWS);
            for b in 0..nb {
                bytes.extend_from_slice(&self.scales[t * nb + b][r].to_le_bytes());
                for quad in &self.quads[(t * nb + b) * qpb..(t * nb + b + 1) * qpb] {
                    let four = &quad.0[r * 4..r * 4 + 4];
                    bytes.extend(four.iter().map(|&q| self.format.ggml(q)));
                }
            }
        }
        bytes
    }
}
