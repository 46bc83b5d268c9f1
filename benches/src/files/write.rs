//! The checkpoints the section loads: written for it, removed when dropped.

use std::io::Write;
use std::path::{Path, PathBuf};

/// A checkpoint written for the benchmark (a file, or shards and their index), removed when
/// dropped.
pub(super) struct Written {
    /// What a load opens: the file, or the shards' index.
    pub(super) path: PathBuf,
    /// The shards' paths (the file alone, unsharded).
    pub(super) files: Vec<PathBuf>,
    /// Bytes of tensor data, all files together.
    pub(super) bytes: usize,
    /// Tensors, all files together.
    pub(super) tensors: usize,
}

impl Drop for Written {
    fn drop(&mut self) {
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A bf16 tensor to write: its name and its elements.
struct Tensor {
    name: String,
    elements: usize,
}

/// Writes a safetensors file of `tensors` (bf16, one dimension each) of varied bytes; returns
/// the bytes of tensor data.
fn write_tensors(path: &Path, tensors: &[Tensor]) -> std::io::Result<usize> {
    let mut header = String::from("{");
    let mut at = 0;
    for (i, tensor) in tensors.iter().enumerate() {
        let end = at + 2 * tensor.elements;
        let comma = if i + 1 < tensors.len() { "," } else { "" };
        header.push_str(&format!(
            "\"{}\":{{\"dtype\":\"BF16\",\"shape\":[{}],\"data_offsets\":[{at},{end}]}}{comma}",
            tensor.name, tensor.elements
        ));
        at = end;
    }
    header.push('}');
    while (8 + header.len()) % 8 != 0 {
        header.push(' ');
    }
    let mut file = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(path)?);
    file.write_all(&(header.len() as u64).to_le_bytes())?;
    file.write_all(header.as_bytes())?;
    let block: Vec<u8> = (0..8 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let mut left = at;
    while left > 0 {
        let n = left.min(block.len());
        file.write_all(&block[..n])?;
        left -= n;
    }
    file.into_inner()?.sync_all()?;
    Ok(at)
}

/// Writes a safetensors file of `tensors` bf16 tensors of `each` bytes, of varied bytes.
pub(super) fn write_checkpoint(
    dir: &Path,
    name: &str,
    tensors: usize,
    each: usize,
) -> std::io::Result<Written> {
    let path = dir.join(name);
    let list: Vec<Tensor> = (0..tensors)
        .map(|i| Tensor {
            name: format!("layer.{i}.weight"),
            elements: each / 2,
        })
        .collect();
    let bytes = write_tensors(&path, &list)?;
    Ok(Written {
        files: vec![path.clone()],
        path,
        bytes,
        tensors,
    })
}

/// The tensors of a decoder shaped like a small language model: one large embedding and
/// output head, and per layer four attention projections (keys and values grouped, an eighth
/// of the queries' width), three MLP weights, their biases and two norms of a few KiB each.
fn decoder(layers: usize, hidden: usize, intermediate: usize, vocab: usize) -> Vec<Tensor> {
    let tensor = |name: String, elements: usize| Tensor { name, elements };
    let grouped = hidden / 8;
    let mut tensors = vec![tensor("model.embed_tokens.weight".into(), vocab * hidden)];
    for layer in 0..layers {
        let at = |part: &str| format!("model.layers.{layer}.{part}");
        for (projection, outputs) in [("q", hidden), ("k", grouped), ("v", grouped), ("o", hidden)]
        {
            let name = |what: &str| at(&format!("self_attn.{projection}_proj.{what}"));
            tensors.push(tensor(name("weight"), outputs * hidden));
            tensors.push(tensor(name("bias"), outputs));
        }
        for (weight, outputs) in [
            ("gate", intermediate),
            ("up", intermediate),
            ("down", hidden),
        ] {
            let name = |what: &str| at(&format!("mlp.{weight}_proj.{what}"));
            tensors.push(tensor(name("weight"), hidden * intermediate));
            tensors.push(tensor(name("bias"), outputs));
        }
        tensors.push(tensor(at("input_layernorm.weight"), hidden));
        tensors.push(tensor(at("post_attention_layernorm.weight"), hidden));
    }
    tensors.push(tensor("model.norm.weight".into(), hidden));
    tensors.push(tensor("lm_head.weight".into(), vocab * hidden));
    tensors
}

/// The decoder of a run: TinyLlama's shape (22 layers of 2,048), or, for a short run, 8
/// layers of 1,024.
fn model(quick: bool) -> (usize, Vec<Tensor>) {
    if quick {
        (8, decoder(8, 1024, 2816, 32_000))
    } else {
        (22, decoder(22, 2048, 5632, 32_000))
    }
}

/// The model-shaped checkpoint's label: its layers and parameters.
pub(super) fn model_label(quick: bool) -> String {
    let (layers, tensors) = model(quick);
    let parameters: usize = tensors.iter().map(|t| t.elements).sum();
    format!(
        "model-shaped: {layers} decoder layers, {:.2} B parameters",
        parameters as f64 / 1e9
    )
}

/// A checkpoint shaped like a decoder (see [`model`]).
pub(super) fn write_model(dir: &Path, name: &str, quick: bool) -> std::io::Result<Written> {
    let (_, tensors) = model(quick);
    let path = dir.join(name);
    let bytes = write_tensors(&path, &tensors)?;
    Ok(Written {
        files: vec![path.clone()],
        path,
        bytes,
        tensors: tensors.len(),
    })
}

/// A checkpoint of `tensors` bf16 tensors of `each` bytes in `shards` files and their index
/// (as Hugging Face shards a model): the written index is what a load opens.
pub(super) fn write_shards(
    dir: &Path,
    name: &str,
    shards: usize,
    tensors: usize,
    each: usize,
) -> std::io::Result<Written> {
    assert!(tensors >= shards, "{tensors} tensors in {shards} shards");
    let mut files = Vec::with_capacity(shards);
    let mut weight_map = Vec::with_capacity(tensors);
    let mut bytes = 0;
    for shard in 0..shards {
        let file_name = format!("{name}-{:05}-of-{shards:05}.safetensors", shard + 1);
        // As even as they go: every shard holds tensors.
        let list: Vec<Tensor> = (shard * tensors / shards..(shard + 1) * tensors / shards)
            .map(|i| Tensor {
                name: format!("layer.{i}.weight"),
                elements: each / 2,
            })
            .collect();
        weight_map.extend(
            list.iter()
                .map(|t| format!("\"{}\":\"{file_name}\"", t.name)),
        );
        let path = dir.join(&file_name);
        bytes += write_tensors(&path, &list)?;
        files.push(path);
    }
    let path = dir.join(format!("{name}.safetensors.index.json"));
    std::fs::write(
        &path,
        format!(
            "{{\"metadata\":{{\"total_size\":{bytes}}},\"weight_map\":{{{}}}}}",
            weight_map.join(",")
        ),
    )?;
    Ok(Written {
        path,
        files,
        bytes,
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_written_checkpoints_open_with_every_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let sharded = write_shards(dir.path(), "s", 3, 7, 4096).unwrap();
        assert_eq!(sharded.files.len(), 3);
        let model = {
            let path = dir.path().join("m.safetensors");
            let tensors = decoder(2, 64, 160, 100);
            let bytes = write_tensors(&path, &tensors).unwrap();
            Written {
                files: vec![path.clone()],
                path,
                bytes,
                tensors: tensors.len(),
            }
        };
        for written in [&sharded, &model] {
            let checkpoint = pinned_io::Checkpoint::open(&written.path).unwrap();
            assert_eq!(checkpoint.tensors().count(), written.tensors);
            assert_eq!(checkpoint.bytes(), written.bytes as u64);
        }
        // Each layer: four projections and three MLP weights, each with its bias, and two norms.
        assert_eq!(model.tensors, 3 + 2 * 16);
        // Every shard holds tensors, however the count divides.
        let uneven = write_shards(dir.path(), "u", 16, 100, 4096).unwrap();
        for file in &uneven.files {
            let header = pinned_io::Checkpoint::open(file).unwrap();
            assert!(header.tensors().count() >= 6, "{}", file.display());
        }
        assert_eq!(
            model_label(false),
            "model-shaped: 22 decoder layers, 1.10 B parameters"
        );
        assert_eq!(
            model_label(true),
            "model-shaped: 8 decoder layers, 0.15 B parameters"
        );
        let paths: Vec<_> = sharded.files.clone();
        drop(sharded);
        assert!(paths.iter().all(|path| !path.exists()));
    }
}
