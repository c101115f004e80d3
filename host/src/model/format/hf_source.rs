//! Weights from a Hugging Face model directory: one or many `*.safetensors` shards, optionally
//! indexed by `model.safetensors.index.json`. Shards are memory-mapped; f32 tensors are borrowed
//! in place, f16/bf16 are converted.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;

use crate::model::shard::Split;

use crate::model::error::LoadError;
use crate::model::format::source::{check_shape, WeightSource};
use crate::model::tensor::Tensor;

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
    data_start: usize,
    meta: Metadata,
}

pub struct SafetensorsSource {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// tensor name -> shard index
    index: BTreeMap<String, usize>,
    /// tensor name -> whether anything read it (a tensor nothing reads is a load error:
    /// `model::unused`).
    read: BTreeMap<String, AtomicBool>,
}

fn io(file: &Path) -> impl FnOnce(std::io::Error) -> LoadError + '_ {
    move |source| LoadError::Io { file: file.to_path_buf(), source }
}

fn open_shard(path: &Path) -> Result<Shard, LoadError> {
    let f = File::open(path).map_err(io(path))?;
    // SAFETY: read-only mapping of a checkpoint file that is not modified while loaded.
    let map = unsafe { Mmap::map(&f) }.map_err(io(path))?;
    let (header_len, meta) = SafeTensors::read_metadata(&map[..])
        .map_err(|e| LoadError::Corrupt { file: path.to_path_buf(), detail: format!("safetensors header: {e}") })?;
    let data_start = 8 + header_len;
    let data_len = map.len() - data_start;
    // read_metadata already checks the offsets are contiguous; check each against the file too so a
    // lying header names the tensor it lies about.
    for (name, info) in meta.tensors() {
        let (start, end) = info.data_offsets;
        let want = info.shape.iter().product::<usize>() * info.dtype.bitsize() / 8;
        if end < start || end > data_len || end - start != want {
            return Err(LoadError::BadTensor {
                file: path.to_path_buf(),
                tensor: name.clone(),
                detail: format!(
                    "header says bytes {start}..{end} for {:?} {:?} ({want} bytes needed, data section has {data_len})",
                    info.dtype, info.shape
                ),
            });
        }
    }
    Ok(Shard { path: path.to_path_buf(), map: Arc::new(map), data_start, meta })
}

/// The shard files of the checkpoint in `dir`, sorted: those `model.safetensors.index.json` maps
/// tensors to, else every `*.safetensors`. Refuses an empty list and names leaving `dir`.
pub fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index_path = dir.join("model.safetensors.index.json");
    let shard_names: Vec<String> = if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(io(&index_path))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| LoadError::Corrupt { file: index_path.clone(), detail: format!("invalid JSON: {e}") })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| LoadError::Corrupt { file: index_path.clone(), detail: "no weight_map object".into() })?;
        let mut names: Vec<String> = map.values().filter_map(|s| s.as_str().map(str::to_string)).collect();
        names.sort();
        names.dedup();
        names
    } else {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        names.sort();
        names
    };
    if shard_names.is_empty() {
        return Err(LoadError::MissingTensor {
            file: dir.to_path_buf(),
            tensor: "*.safetensors (no weight files in directory)".into(),
        });
    }
    shard_names
        .into_iter()
        .map(|name| {
            if name.contains('/') || name.contains("..") {
                return Err(LoadError::Corrupt {
                    file: index_path.clone(),
                    detail: format!("shard name '{name}' leaves the model directory"),
                });
            }
            Ok(dir.join(name))
        })
        .collect()
}

impl SafetensorsSource {
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let mut shards = Vec::new();
        let mut index = BTreeMap::new();
        for path in shard_paths(dir)? {
            let shard = open_shard(&path)?;
            for tensor in shard.meta.tensors().keys() {
                index.insert(tensor.clone(), shards.len());
            }
            shards.push(shard);
        }
        let read = index.keys().map(|k| (k.clone(), AtomicBool::new(false))).collect();
        Ok(Self { dir: dir.to_path_buf(), shards, index, read })
    }
}

/// A tensor's stored bytes, undecoded (packed integer codes, scales of any dtype).
pub struct RawTensor<'a> {
    pub file: &'a Path,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl SafetensorsSource {
    fn mark_read(&self, name: &str) {
        if let Some(flag) = self.read.get(name) {
            flag.store(true, Ordering::Relaxed);
        }
    }

    /// The stored form of `name` (quantized checkpoints keep int32/uint8 codes and scales).
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>, LoadError> {
        self.mark_read(name);
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| LoadError::MissingTensor { file: self.dir.clone(), tensor: name.to_string() })?;
        let info = shard.meta.info(name).expect("indexed tensor has metadata");
        let bytes = &shard.map[shard.data_start + info.data_offsets.0..shard.data_start + info.data_offsets.1];
        Ok(RawTensor { file: &shard.path, dtype: info.dtype, shape: &info.shape, bytes })
    }

    /// Names of all tensors in the checkpoint, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
}

impl WeightSource for SafetensorsSource {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        self.mark_read(name);
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| LoadError::MissingTensor { file: self.dir.clone(), tensor: name.to_string() })?;
        let info = shard.meta.info(name).expect("indexed tensor has metadata");
        check_shape(&shard.path, name, &info.shape, shape)?;
        let n = info.shape.iter().product::<usize>();
        let offset = shard.data_start + info.data_offsets.0;
        let bytes = &shard.map[offset..shard.data_start + info.data_offsets.1];
        let data: Vec<f32> = match info.dtype {
            Dtype::F32 => {
                if let Some(t) = Tensor::mapped(info.shape.clone(), &shard.map, offset, n) {
                    return Ok(t);
                }
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            Dtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => {
                return Err(LoadError::BadTensor {
                    file: shard.path.clone(),
                    tensor: name.to_string(),
                    detail: format!("dtype {other:?} is not supported for this weight (expected F32, F16 or BF16)"),
                })
            }
        };
        Ok(Tensor::owned(info.shape.clone(), data))
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn unread(&self) -> Option<Vec<String>> {
        Some(self.read.iter().filter(|(_, r)| !r.load(Ordering::Relaxed)).map(|(n, _)| n.clone()).collect())
    }

    fn file_of(&self, name: &str) -> PathBuf {
        self.index.get(name).map(|&i| self.shards[i].path.clone()).unwrap_or_else(|| self.dir.clone())
    }

    /// Decodes only this rank's rows or columns, so a tensor-parallel rank never holds the
    /// whole tensor in f32.
    fn load_split(&self, name: &str, shape: &[usize], split: &Split) -> Result<Tensor, LoadError> {
        if *split == Split::Full {
            return self.load(name, shape);
        }
        let raw = self.raw(name)?;
        check_shape(raw.file, name, raw.shape, shape)?;
        let bad =
            |detail: String| LoadError::BadTensor { file: raw.file.to_path_buf(), tensor: name.to_string(), detail };
        let part = split.shape(raw.shape).map_err(bad)?;
        let esize = match raw.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(bad(format!(
                    "dtype {other:?} is not supported for this weight (expected F32, F16 or BF16)"
                )))
            }
        };
        let width: usize = raw.shape[1..].iter().product();
        let mut bytes = Vec::with_capacity(part.iter().product::<usize>() * esize);
        match split {
            Split::Full => unreachable!("handled above"),
            Split::Rows(r) => bytes.extend_from_slice(&raw.bytes[r.start * width * esize..r.end * width * esize]),
            Split::Cols(c) => {
                for row in raw.bytes.chunks_exact((width * esize).max(1)) {
                    bytes.extend_from_slice(&row[c.start * esize..c.end * esize]);
                }
            }
        }
        let data: Vec<f32> = match raw.dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        };
        Ok(Tensor::owned(part, data))
    }

    fn linear_split(
        &self,
        module: &str,
        rows: usize,
        cols: usize,
        split: &Split,
    ) -> Result<crate::model::layers::linear::Linear, LoadError> {
        self.load_split(&format!("{module}.weight"), &[rows, cols], split)
            .map(crate::model::layers::linear::Linear::Dense)
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        let shard = &self.shards[*self.index.get(name)?];
        shard.meta.info(name).map(|info| info.shape.clone())
    }
}
