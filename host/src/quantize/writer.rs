//! Streaming safetensors writer: the header is written up front from the planned list of tensors
//! (names, dtypes, shapes are all known before any data is produced), then each tensor's bytes
//! are appended in plan order, so only one tensor has to be in memory at a time.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

pub struct Planned {
    pub name: String,
    /// safetensors dtype name: "U8", "I32", "I64", "F16", "BF16", "F32".
    pub dtype: String,
    pub shape: Vec<usize>,
}

fn dtype_bytes(d: &str) -> usize {
    match d {
        "U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        _ => 8,
    }
}

impl Planned {
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * dtype_bytes(&self.dtype)
    }
    pub fn bits(&self) -> u64 {
        self.bytes() as u64 * 8
    }
}

pub struct StreamWriter {
    out: BufWriter<File>,
    plan: Vec<Planned>,
    next: usize,
}

impl StreamWriter {
    pub fn create(path: &Path, plan: Vec<Planned>) -> Result<Self> {
        let mut header = Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut offset = 0usize;
        for p in &plan {
            let end = offset + p.bytes();
            header.insert(p.name.clone(), json!({"dtype": p.dtype, "shape": p.shape, "data_offsets": [offset, end]}));
            offset = end;
        }
        let mut text = Value::Object(header).to_string().into_bytes();
        // Data starts 8-byte aligned (the safetensors convention: pad the header with spaces).
        while !(8 + text.len()).is_multiple_of(8) {
            text.push(b' ');
        }
        let f = File::create_new(path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, f);
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(&text)?;
        Ok(Self { out, plan, next: 0 })
    }

    /// Appends the data of the next planned tensor, which must be `name` and have its size.
    pub fn write(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let Some(p) = self.plan.get(self.next) else { bail!("writer: unplanned tensor {name}") };
        if p.name != name || p.bytes() != data.len() {
            bail!("writer: got {name} ({} bytes), planned {} ({} bytes)", data.len(), p.name, p.bytes());
        }
        self.out.write_all(data)?;
        self.next += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        if self.next != self.plan.len() {
            bail!("writer: {} of {} tensors written", self.next, self.plan.len());
        }
        self.out.flush()?;
        Ok(())
    }
}
