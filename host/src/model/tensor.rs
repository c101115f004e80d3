//! Host tensors in f32. Data is either owned (dequantised or converted) or borrowed straight from
//! a memory-mapped file when it is already little-endian f32 and aligned, so nothing is copied.

use std::sync::Arc;

use memmap2::Mmap;

pub enum TensorData {
    Owned(Vec<f32>),
    Mapped { map: Arc<Mmap>, offset: usize, len: usize },
}

pub struct Tensor {
    pub shape: Vec<usize>,
    data: TensorData,
}

impl Tensor {
    pub fn owned(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data: TensorData::Owned(data) }
    }

    /// Borrows `len` f32 values at `offset` of `map` if they are suitably aligned; `None` otherwise.
    pub fn mapped(shape: Vec<usize>, map: &Arc<Mmap>, offset: usize, len: usize) -> Option<Self> {
        let ptr = map.as_ptr() as usize + offset;
        let fits = offset.checked_add(len * 4).is_some_and(|end| end <= map.len());
        (cfg!(target_endian = "little") && ptr.is_multiple_of(std::mem::align_of::<f32>()) && fits)
            .then(|| Self { shape, data: TensorData::Mapped { map: map.clone(), offset, len } })
    }

    pub fn as_slice(&self) -> &[f32] {
        match &self.data {
            TensorData::Owned(v) => v,
            // SAFETY: alignment, length and endianness were checked in `mapped`; the map lives as
            // long as self through the Arc.
            TensorData::Mapped { map, offset, len } => unsafe {
                std::slice::from_raw_parts(map.as_ptr().add(*offset) as *const f32, *len)
            },
        }
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.data, TensorData::Mapped { .. })
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
