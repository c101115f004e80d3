//! Dense LSB-first bit streams of `b`-bit codes (1 ≤ b ≤ 8), one stream per matrix row.
//!
//! Element `j` of a row occupies bits `j·b .. j·b+b` of the row's byte string, least significant
//! bit first. This is compressed-tensors' `pack_to_int32` layout read as little-endian bytes (for
//! b = 4: element 0 in the low nibble of byte 0), MXFP4's nibble order (element 2k low nibble of
//! byte k), and the Cubic format's layout, so one decoder serves all three.

/// Bytes the SIMD decoders may read past the start of the last chunk of the last row.
pub const SLACK: usize = 16;

/// Bytes a row of `cols` codes of `bits` bits takes when rounded up to whole bytes.
pub fn row_bytes(cols: usize, bits: u32) -> usize {
    (cols * bits as usize).div_ceil(8)
}

/// Code `j` of a row starting at `row[0]`. The row must be followed by one readable byte (the
/// next row or the buffer's slack) because a code may straddle two bytes.
#[inline(always)]
pub fn code_at(row: &[u8], bits: u32, j: usize) -> u32 {
    let p = j * bits as usize;
    let (byte, shift) = (p / 8, (p % 8) as u32);
    let pair = row[byte] as u32 | (row.get(byte + 1).copied().unwrap_or(0) as u32) << 8;
    (pair >> shift) & ((1u32 << bits) - 1)
}

/// Packs `codes` (each below `2^bits`) into one dense row of `row_bytes(codes.len(), bits)` bytes.
pub fn pack_row(codes: &[u8], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; row_bytes(codes.len(), bits)];
    for (j, &c) in codes.iter().enumerate() {
        debug_assert!((c as u32) < (1 << bits), "code {c} does not fit in {bits} bits");
        let p = j * bits as usize;
        let v = (c as u32) << (p % 8);
        out[p / 8] |= v as u8;
        if v >> 8 != 0 {
            out[p / 8 + 1] |= (v >> 8) as u8;
        }
    }
    out
}

/// Unpacks `cols` codes from one dense row.
pub fn unpack_row(row: &[u8], bits: u32, cols: usize) -> Vec<u8> {
    (0..cols).map(|j| code_at(row, bits, j) as u8).collect()
}

/// A row-major matrix of packed codes: `rows` rows of `cols` codes, each row `stride` bytes
/// (at least `row_bytes(cols, bits)`; compressed-tensors pads rows to whole int32 words), plus
/// `SLACK` zero bytes at the end so vector loads of the last chunk stay inside the buffer.
#[derive(Clone, Debug)]
pub struct PackedRows {
    bits: u32,
    rows: usize,
    cols: usize,
    stride: usize,
    data: Vec<u8>,
}

impl PackedRows {
    /// Copies `rows × stride` bytes of packed codes. Panics if the sizes disagree.
    pub fn new(bits: u32, rows: usize, cols: usize, stride: usize, bytes: &[u8]) -> Self {
        assert!((1..=8).contains(&bits), "PackedRows: {bits} bits (1..=8 supported)");
        assert!(
            stride >= row_bytes(cols, bits),
            "PackedRows: stride {stride} too small for {cols} codes of {bits} bits"
        );
        assert_eq!(bytes.len(), rows * stride, "PackedRows: {} bytes for {rows} rows of {stride}", bytes.len());
        let mut data = Vec::with_capacity(bytes.len() + SLACK);
        data.extend_from_slice(bytes);
        data.resize(bytes.len() + SLACK, 0);
        Self { bits, rows, cols, stride, data }
    }

    /// Packs a row-major matrix of codes densely (stride = `row_bytes(cols, bits)`).
    pub fn from_codes(bits: u32, rows: usize, cols: usize, codes: &[u8]) -> Self {
        assert_eq!(codes.len(), rows * cols);
        let stride = row_bytes(cols, bits);
        let mut bytes = Vec::with_capacity(rows * stride);
        for r in 0..rows {
            bytes.extend_from_slice(&pack_row(&codes[r * cols..(r + 1) * cols], bits));
        }
        Self::new(bits, rows, cols, stride, &bytes)
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Row `r` and everything after it (the decoders read a little past the row's end).
    #[inline(always)]
    pub fn row_tail(&self, r: usize) -> &[u8] {
        &self.data[r * self.stride..]
    }

    #[inline(always)]
    pub fn code(&self, r: usize, j: usize) -> u32 {
        code_at(self.row_tail(r), self.bits, j)
    }

    /// The `rows × stride` packed bytes (without slack), e.g. to upload to a device.
    pub fn bytes(&self) -> &[u8] {
        &self.data[..self.rows * self.stride]
    }

    /// Bytes of packed codes (without slack), for bandwidth accounting.
    pub fn packed_bytes(&self) -> usize {
        self.rows * self.stride
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_unpack_round_trips_every_width() {
        for bits in 1..=8u32 {
            let codes: Vec<u8> = (0..77).map(|i| ((i * 37 + 11) % (1 << bits)) as u8).collect();
            let row = pack_row(&codes, bits);
            assert_eq!(row.len(), row_bytes(77, bits));
            assert_eq!(unpack_row(&row, bits, 77), codes, "{bits} bits");
        }
    }

    #[test]
    fn four_bit_layout_is_low_nibble_first() {
        // compressed-tensors: int32 word 0x87654321 holds elements 1,2,...,8 (element 0 lowest).
        let word: u32 = 0x8765_4321;
        let row = word.to_le_bytes();
        let got: Vec<u32> = (0..8).map(|j| code_at(&row, 4, j)).collect();
        assert_eq!(got, vec![1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn three_bit_codes_straddle_bytes() {
        // Elements 0..8 of 3 bits = 24 bits; element 2 spans bits 6..9.
        let codes = [1u8, 2, 5, 7, 0, 3, 6, 4];
        let row = pack_row(&codes, 3);
        let mut v: u32 = 0;
        for (j, &c) in codes.iter().enumerate() {
            v |= (c as u32) << (3 * j);
        }
        assert_eq!(row, v.to_le_bytes()[..3].to_vec());
    }
}
