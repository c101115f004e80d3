//! GGUF v2/v3 reader: header, metadata and tensor index, with the data section memory-mapped.
//!
//! Every read is bounds-checked against the file length so a truncated or corrupt file yields a
//! [`LoadError`] naming the file (and tensor), never a panic or an out-of-bounds read.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::model::error::LoadError;
use crate::model::format::ggml::GgmlType;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) if v >= 0 => Some(v as u64),
            MetaValue::I16(v) if v >= 0 => Some(v as u64),
            MetaValue::I32(v) if v >= 0 => Some(v as u64),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Where one tensor's bytes live inside the file.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` is the contiguous (fastest) one.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the tensor data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Shape in PyTorch order (outermost first).
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<GgufTensorInfo>,
    by_name: BTreeMap<String, usize>,
    map: Arc<Mmap>,
}

/// Limits that stop a corrupt header from making us allocate absurd amounts.
const MAX_STRING_LEN: u64 = 64 << 20;
const MAX_ARRAY_LEN: u64 = 64 << 20;
const MAX_DIMS: u32 = 8;

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> LoadError {
        LoadError::Corrupt { file: self.path.to_path_buf(), detail: format!("{} (at byte {})", what.into(), self.pos) }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], LoadError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(LoadError::Truncated {
                file: self.path.to_path_buf(),
                detail: format!(
                    "file ends while reading {what} at byte {} (file has {} bytes)",
                    self.pos,
                    self.bytes.len()
                ),
            }),
        }
    }
    fn u8(&mut self, what: &str) -> Result<u8, LoadError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, LoadError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, LoadError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String, LoadError> {
        let len = self.u64(what)?;
        if len > MAX_STRING_LEN {
            return Err(self.err(format!("{what}: string length {len} is implausible")));
        }
        let raw = self.take(len as usize, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.err(format!("{what}: string is not valid UTF-8")))
    }
    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<MetaValue, LoadError> {
        let b = |c: &mut Self, n| c.take(n, what).map(|s| s.to_vec());
        Ok(match ty {
            0 => MetaValue::U8(self.u8(what)?),
            1 => MetaValue::I8(self.u8(what)? as i8),
            2 => MetaValue::U16(u16::from_le_bytes(b(self, 2)?.try_into().unwrap())),
            3 => MetaValue::I16(i16::from_le_bytes(b(self, 2)?.try_into().unwrap())),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(self.u32(what)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(what)?)),
            7 => MetaValue::Bool(self.u8(what)? != 0),
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth > 2 {
                    return Err(self.err(format!("{what}: arrays nested too deeply")));
                }
                let elem_ty = self.u32(what)?;
                let len = self.u64(what)?;
                if len > MAX_ARRAY_LEN {
                    return Err(self.err(format!("{what}: array length {len} is implausible")));
                }
                let mut items = Vec::with_capacity((len as usize).min(1 << 16));
                for _ in 0..len {
                    items.push(self.value(elem_ty, what, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(self.u64(what)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(what)?)),
            other => return Err(self.err(format!("{what}: unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let file = File::open(path).map_err(|e| LoadError::Io { file: path.to_path_buf(), source: e })?;
        // SAFETY: the mapping is read-only; like every mmap user we rely on the file not being
        // truncated underneath us while the server runs.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::Io { file: path.to_path_buf(), source: e })?;
        let map = Arc::new(map);
        let mut c = Cursor { bytes: &map[..], pos: 0, path };
        let magic = c.take(4, "magic")?;
        if magic != b"GGUF" {
            return Err(LoadError::Corrupt {
                file: path.to_path_buf(),
                detail: "not a GGUF file (magic bytes are not 'GGUF')".into(),
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("unsupported GGUF version {version} (supported: 2, 3)")));
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        if n_tensors > 1 << 24 || n_kv > 1 << 20 {
            return Err(c.err(format!("implausible header: {n_tensors} tensors, {n_kv} metadata entries")));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = metadata.get("general.alignment").and_then(MetaValue::as_u64).unwrap_or(32) as usize;
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(c.err(format!("general.alignment {alignment} is not a power of two")));
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(c.err(format!("tensor '{name}': {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let ty = c.u32(&name)?;
            let offset = c.u64(&name)?;
            raw.push((name, dims, ty, offset));
        }
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let file_len = map.len();
        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = BTreeMap::new();
        for (name, dims, ty, offset) in raw {
            let bad = |detail: String| LoadError::BadTensor { file: path.to_path_buf(), tensor: name.clone(), detail };
            let ggml_type = GgmlType::from_id(ty).ok_or_else(|| bad(format!("unknown ggml type id {ty}")))?;
            let n_el = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad("element count overflows".into()))?;
            let n_bytes = ggml_type.bytes_for(dims[0], n_el).map_err(bad)?;
            let start = (data_start as u64).checked_add(offset).ok_or_else(|| bad("offset overflows".into()))?;
            let end = start.checked_add(n_bytes as u64).ok_or_else(|| bad("size overflows".into()))?;
            if end > file_len as u64 {
                return Err(LoadError::Truncated {
                    file: path.to_path_buf(),
                    detail: format!(
                        "tensor '{name}' needs bytes {start}..{end} but the file has only {file_len} bytes"
                    ),
                });
            }
            by_name.insert(name.clone(), tensors.len());
            tensors.push(GgufTensorInfo { name, dims, ggml_type, offset: start as usize, n_bytes });
        }
        Ok(Self { path: path.to_path_buf(), version, metadata, tensors, by_name, map })
    }

    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked at open).
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.map[info.offset..info.offset + info.n_bytes]
    }

    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.map
    }
}
