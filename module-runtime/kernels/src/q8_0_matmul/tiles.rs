//! The weight in the kernels' own layout: [`Tiles`] of 16 output rows by one block of 32 inputs,
//! for `q8_0`, `q4_0` and `q4_K` weights, which hold every byte of the weight (so they replace
//! it: [`QuantizedLayout`]).

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
    /// ggml's `q4_K` super-blocks of 256 inputs (8 blocks of 32, each with a 6-bit scale and
    /// minimum; a float16 `d` and `dmin` per super-block; weight `d·sc·q − dmin·m`). Per tile
    /// and super-block: 32 quads, quad `8j + g` holding each row's bytes `32j + 4g..` of its 128
    /// nibble bytes (low nibbles: inputs `64j + 4g..`, high: `64j + 32 + 4g..`, the super-block's
    /// blocks `2j` and `2j + 1`), so 4 quads per block; and 8 scale entries: the 16 rows' `d`,
    /// their `dmin`, then their 12 scale bytes as bytes, byte `k` of row `r` at `16k + r` (see
    /// [`q4k_header`]).
    Q4K,
}

/// Blocks of 32 inputs per `q4_K` super-block.
pub(super) const Q4K_BLOCKS: usize = 8;

/// ggml's bytes per `q4_K` super-block of one row: `d`, `dmin`, 12 scale bytes, 128 nibble bytes.
const Q4K_BYTES: usize = 144;

/// The 12 scale bytes of a tile's `q4_K` super-block as bytes: byte `k` of row `r` at `16k + r`
/// (`entries` are the super-block's 8 scale entries; the bytes are the last 6).
pub(super) fn q4k_header(entries: &[[u16; ROWS]]) -> &[u8] {
    let bytes = &entries[2..Q4K_BLOCKS];
    // SAFETY: `[u16; 16]` entries are 32 contiguous bytes each, with no padding, and any byte is
    // a valid `u8`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u8>(), bytes.len() * 2 * ROWS) }
}

/// [`q4k_header`], to write.
fn q4k_header_mut(entries: &mut [[u16; ROWS]]) -> &mut [u8] {
    let bytes = &mut entries[2..Q4K_BLOCKS];
    // SAFETY: as in `q4k_header`, and the borrow is unique.
    unsafe {
        std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<u8>(), bytes.len() * 2 * ROWS)
    }
}

/// `q4_K`'s 6-bit scale and minimum of block `j` (0..8) from its 12 scale bytes (ggml's
/// `get_scale_min_k4`).
pub(super) fn q4k_scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl Format {
    /// Quads per tile and block.
    pub(super) fn quads(self) -> usize {
        match self {
            Format::Q8 => 8,
            Format::Q4 | Format::Q4K => 4,
        }
    }

    /// ggml's bytes per block of 32 of one row: the float16 scale, then the weights (`q4_K`: a
    /// super-block's 144 bytes over its 8 blocks).
    fn block_bytes(self) -> usize {
        2 + self.quads() * 4
    }

    /// Inputs of one unit of ggml's layout (a block, or `q4_K`'s super-block).
    fn unit(self) -> usize {
        match self {
            Format::Q4K => Q4K_BLOCKS * BLOCK,
            _ => BLOCK,
        }
    }

    /// The byte stored for ggml's byte `v` (and back: [`ggml`](Self::ggml)).
    fn stored(self, v: u8) -> u8 {
        match self {
            Format::Q8 => v.wrapping_add(128),
            Format::Q4 | Format::Q4K => v,
        }
    }

    /// ggml's byte for the stored byte `v`.
    fn ggml(self, v: u8) -> u8 {
        match self {
            Format::Q8 => v.wrapping_sub(128),
            Format::Q4 | Format::Q4K => v,
        }
    }
}

/// A `q8_0`, `q4_0` or `q4_K` weight `[n, k]` in tiles of 16 rows by one block (see the
/// module's docs).
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
    /// The tiles of `w`, or `None` when it is not a CPU `q8_0`, `q4_0` or `q4_K` matrix.
    pub(super) fn new(w: &QTensor) -> Option<Self> {
        let format = match w.dtype() {
            GgmlDType::Q8_0 => Format::Q8,
            GgmlDType::Q4_0 => Format::Q4,
            GgmlDType::Q4K => Format::Q4K,
            _ => return None,
        };
        if !w.device().is_cpu() {
            return None;
        }
        let (n, k) = w.shape().dims2().ok()?;
        let data = w.data().ok()?;
        let (nb, qpb, bytes) = (k / BLOCK, format.quads(), format.block_bytes());
        if k % format.unit() != 0 || data.len() != n * nb * bytes {
            return None;
        }
        let tiles = n.div_ceil(ROWS);
        // Padding rows: weights of zero (128 in `q8_0`'s unsigned bytes, nibbles of 8; `q4_K`:
        // `d` and `dmin` 0), scale 0.
        let pad = match format {
            Format::Q8 => 128,
            Format::Q4 => 0x88,
            Format::Q4K => 0,
        };
        let mut quads = vec![Quad([pad; 64]); tiles * nb * qpb];
        let mut scales = vec![[0u16; ROWS]; tiles * nb];
        match format {
            Format::Q4K => fill_q4k(&data, n, nb, &mut quads, &mut scales),
            _ => fill_blocks(format, &data, n, nb, &mut quads, &mut scales),
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

/// [`Tiles::new`]'s filling for `q8_0` and `q4_0`: `data` is `n` rows of `nb` blocks, each its
/// float16 scale then its weight bytes.
fn fill_blocks(
    format: Format,
    data: &[u8],
    n: usize,
    nb: usize,
    quads: &mut [Quad],
    scales: &mut [[u16; ROWS]],
) {
    let (qpb, bytes) = (format.quads(), format.block_bytes());
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
}

/// [`Tiles::new`]'s filling for `q4_K` (see [`Format::Q4K`]): `data` is `n` rows of `nb / 8`
/// super-blocks of [`Q4K_BYTES`].
fn fill_q4k(data: &[u8], n: usize, nb: usize, quads: &mut [Quad], scales: &mut [[u16; ROWS]]) {
    let supers = nb / Q4K_BLOCKS;
    for row in 0..n {
        let (t, r) = (row / ROWS, row % ROWS);
        for s in 0..supers {
            let ggml = &data[(row * supers + s) * Q4K_BYTES..][..Q4K_BYTES];
            let first = t * nb + s * Q4K_BLOCKS;
            let entries = &mut scales[first..first + Q4K_BLOCKS];
            entries[0][r] = u16::from_le_bytes([ggml[0], ggml[1]]);
            entries[1][r] = u16::from_le_bytes([ggml[2], ggml[3]]);
            let header = q4k_header_mut(entries);
            for (k, v) in ggml[4..16].iter().enumerate() {
                header[16 * k + r] = *v;
            }
            for (q, four) in ggml[16..].chunks_exact(4).enumerate() {
                quads[first * 4 + q].0[r * 4..r * 4 + 4].copy_from_slice(four);
            }
        }
    }
}

/// [`QuantizedLayout::row_bytes`] of `q4_K` tiles.
fn q4k_row_bytes(tiles: &Tiles, rows: &[usize]) -> Vec<u8> {
    let nb = tiles.k / BLOCK;
    let supers = nb / Q4K_BLOCKS;
    let mut bytes = Vec::with_capacity(rows.len() * supers * Q4K_BYTES);
    for &row in rows {
        let (t, r) = (row / ROWS, row % ROWS);
        for s in 0..supers {
            let first = t * nb + s * Q4K_BLOCKS;
            let entries = &tiles.scales[first..first + Q4K_BLOCKS];
            bytes.extend_from_slice(&entries[0][r].to_le_bytes());
            bytes.extend_from_slice(&entries[1][r].to_le_bytes());
            let header = q4k_header(entries);
            bytes.extend((0..12).map(|k| header[16 * k + r]));
            for quad in &tiles.quads[first * 4..(first + Q4K_BLOCKS) * 4] {
                bytes.extend_from_slice(&quad.0[r * 4..r * 4 + 4]);
            }
        }
    }
    bytes
}

/// [`QuantizedLayout::row_bytes`] of `q8_0` and `q4_0` tiles.
fn block_row_bytes(tiles: &Tiles, rows: &[usize]) -> Vec<u8> {
    let (nb, qpb, format) = (tiles.k / BLOCK, tiles.format.quads(), tiles.format);
    let mut bytes = Vec::with_capacity(rows.len() * nb * format.block_bytes());
    for &row in rows {
        let (t, r) = (row / ROWS, row % ROWS);
        for b in 0..nb {
            bytes.extend_from_slice(&tiles.scales[t * nb + b][r].to_le_bytes());
            for quad in &tiles.quads[(t * nb + b) * qpb..(t * nb + b + 1) * qpb] {
                let four = &quad.0[r * 4..r * 4 + 4];
                bytes.extend(four.iter().map(|&q| format.ggml(q)));
            }
        }
    }
    bytes
}

/// The tiles hold every byte of the weight (regrouped; `q8_0`'s bytes plus 128): once they are
/// made, the weight's own bytes are dropped and its rows come back from here.
impl QuantizedLayout for Tiles {
    fn holds_weight(&self) -> bool {
        true
    }

    fn row_bytes(&self, rows: &[usize]) -> Vec<u8> {
        match self.format {
            Format::Q4K => q4k_row_bytes(self, rows),
            _ => block_row_bytes(self, rows),
        }
    }
}
