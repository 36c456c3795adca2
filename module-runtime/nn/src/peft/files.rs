//! PEFT's adapter folder, both ways: `adapter_config.json` and `adapter_model.safetensors` with
//! PEFT's keys (`base_model.model.<path>.lora_A.weight`, …).

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::peft::config::LoraConfig;
use crate::peft::model::{
    commit, lora_layers, prepare, trained_biases, PeftExt, ADAPTER_DICTS, DEFAULT_ADAPTER,
};
use crate::peft::saved::{own_params, saved_layers};
use crate::{Module, Param};
use module_core::names::named_parameters;
use module_core::{Names, PeftError};
use module_state::{LoadOptions, StateDict};

/// The configuration's file in an adapter folder.
pub const ADAPTER_CONFIG_NAME: &str = "adapter_config.json";
/// The weights' file in an adapter folder.
pub const ADAPTER_WEIGHTS_NAME: &str = "adapter_model.safetensors";
/// The weights' file of older PEFT versions (a PyTorch pickle), read when there is no
/// safetensors file.
const ADAPTER_WEIGHTS_BIN: &str = "adapter_model.bin";
/// What PEFT's keys start with: `PeftModel.base_model` (the `LoraModel`) and its `model`.
const PREFIX: &str = "base_model.model.";

/// The file key of a tensor of the adapter on `path` (`lora_A`, `lora_B`, or DoRA's magnitude).
fn file_key(path: &str, part: &str) -> String {
    match part {
        // PEFT's parameters (not modules): no `.weight`.
        "lora_magnitude_vector" | "lora_embedding_A" | "lora_embedding_B" => {
            format!("{PREFIX}{path}.{part}")
        }
        _ => format!("{PREFIX}{path}.{part}.weight"),
    }
}

/// The folder PEFT saves the adapter `name` in: `dir` for `"default"`, `dir/<name>` otherwise.
fn folder(dir: &Path, name: &str) -> PathBuf {
    if name == DEFAULT_ADAPTER {
        dir.to_owned()
    } else {
        dir.join(name)
    }
}

fn io_error(path: &Path, source: std::io::Error) -> crate::Error {
    crate::Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// Every adapter of `model` in PEFT's layout under `dir`.
pub(crate) fn save(model: &dyn Module, dir: &Path) -> Result<Vec<PathBuf>> {
    let names = model.adapter_names();
    if names.is_empty() {
        return Err(PeftError::NoAdapter {
            adapter: DEFAULT_ADAPTER.to_owned(),
            available: Vec::new(),
        }
        .into());
    }
    let mut written = Vec::new();
    for name in names {
        let mut weights = StateDict::new();
        let mut config: Option<std::sync::Arc<LoraConfig>> = None;
        for (path, lora) in lora_layers(model) {
            let Some(settings) = lora.settings(&name) else {
                continue;
            };
            config.get_or_insert_with(|| settings.config.clone());
            let value = |p: &Param| -> Result<candle_core::Tensor> {
                Ok(p.tensor()?.detach().contiguous()?)
            };
            let mut put = |part: &str, p: &Param| -> Result<()> {
                weights.insert(file_key(&path, part), value(p)?);
                Ok(())
            };
            if let Some(a) = lora.lora_embedding_a.get(&name) {
                put("lora_embedding_A", a)?;
                put("lora_embedding_B", &lora.lora_embedding_b[&name])?;
            } else {
                put("lora_A", lora.lora_a[name.as_str()].weight())?;
                put("lora_B", lora.lora_b[name.as_str()].weight())?;
            }
            if let Some(m) = lora.lora_magnitude_vector.get(&name) {
                put("lora_magnitude_vector", &m.weight)?;
            }
        }
        for (path, saved) in saved_layers(model) {
            if let Some(copy) = saved.modules_to_save.get(&name) {
                for (leaf, p) in own_params(copy) {
                    let key = format!("{PREFIX}{path}.{leaf}");
                    weights.insert(key, p.tensor()?.detach().contiguous()?);
                }
            }
        }
        let config = config.expect("an adapter has a LoRA layer");
        // PEFT's `bias`: the trained biases are part of the adapter.
        let layers: Vec<String> = lora_layers(model)
            .into_iter()
            .filter(|(_, l)| l.has(&name))
            .map(|(p, _)| p)
            .collect();
        for (_, peft, p) in trained_biases(model, config.bias, &layers, &[]) {
            let key = format!("{PREFIX}{peft}");
            if weights.get(&key).is_none() {
                weights.insert(key, p.tensor()?.detach().contiguous()?);
            }
        }
        let out = folder(dir, &name);
        std::fs::create_dir_all(&out).map_err(|e| io_error(&out, e))?;
        let json = serde_json::to_string_pretty(&serde_json::Value::Object(config.to_json()))
            .expect("a JSON value serializes");
        let config_path = out.join(ADAPTER_CONFIG_NAME);
        let tmp = out.join(format!(".{ADAPTER_CONFIG_NAME}.tmp"));
        std::fs::write(&tmp, json).map_err(|e| io_error(&tmp, e))?;
        weights.save_safetensors(out.join(ADAPTER_WEIGHTS_NAME))?;
        std::fs::rename(&tmp, &config_path).map_err(|e| io_error(&config_path, e))?;
        written.push(out);
    }
    Ok(written)
}

/// Reads the adapter folder `dir` into `model` as the adapter `name`, strictly, all or nothing.
pub(crate) fn load(
    model: &mut dyn Module,
    dir: &Path,
    name: &str,
    is_trainable: bool,
) -> Result<Vec<String>> {
    let config = LoraConfig::from_json_file(dir.join(ADAPTER_CONFIG_NAME))?;
    let mut weights_path = dir.join(ADAPTER_WEIGHTS_NAME);
    if !weights_path.exists() && dir.join(ADAPTER_WEIGHTS_BIN).exists() {
        weights_path = dir.join(ADAPTER_WEIGHTS_BIN);
    }
    let weights = StateDict::read(&weights_path, &LoadOptions::default())?;
    let prepared = prepare(model, name, &config)?;
    // Every tensor the adapted layers need, by file key, with the path it belongs to and whether
    // it is one of the base model's (a bias PEFT's `bias` trains).
    let mut expected: Vec<(String, String, Param, bool)> = Vec::new();
    for (path, adapter) in &prepared.adapters {
        for (part, p) in adapter.weights.parts() {
            expected.push((file_key(path, part), path.clone(), p.clone(), false));
        }
    }
    // `modules_to_save` copies: their own parameters under the layer's path, as PEFT saves them.
    for (path, copy) in &prepared.saved {
        for (leaf, p) in own_params(copy) {
            expected.push((format!("{PREFIX}{path}.{leaf}"), path.clone(), p, false));
        }
    }
    let layers: Vec<String> = prepared.adapters.iter().map(|(p, _)| p.clone()).collect();
    for (path, peft, p) in trained_biases(model, config.bias, &layers, &layers) {
        let key = format!("{PREFIX}{peft}");
        if !expected.iter().any(|(k, ..)| *k == key) {
            expected.push((key, path, p, true));
        }
    }
    let missing: Vec<String> = expected
        .iter()
        .filter(|(k, ..)| weights.get(k).is_none())
        .map(|(k, ..)| k.clone())
        .collect();
    let unexpected: Vec<String> = weights
        .iter()
        .filter(|(k, _)| !expected.iter().any(|(e, ..)| e == k))
        .map(|(k, _)| k.to_owned())
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() {
        return Err(PeftError::Keys {
            missing,
            unexpected,
        }
        .into());
    }
    let mut values = Vec::with_capacity(expected.len());
    for (key, path, param, _) in &expected {
        let value = weights.get(key).expect("checked above");
        if value.dims() != param.shape().dims() {
            return Err(PeftError::Shape {
                key: key.clone(),
                path: path.to_string(),
                expected: param.shape().dims().to_vec(),
                found: value.dims().to_vec(),
            }
            .into());
        }
        values.push(value.to_dtype(param.dtype())?);
    }
    // The new adapters' values, then the adapters added, then the base's biases: nothing of the
    // model changes before every check has passed.
    for ((_, _, param, base), value) in expected.iter().zip(&values) {
        if !base {
            param.set(value)?;
        }
    }
    let paths = commit(model, prepared)?;
    for ((_, _, param, base), value) in expected.iter().zip(&values) {
        if *base {
            param.set(value)?;
        }
    }
    if !is_trainable {
        // PEFT's `is_trainable=False`: the loaded adapter (and the biases it trained) is for
        // inference.
        let parts: Vec<String> = (ADAPTER_DICTS.iter().chain(&["modules_to_save"]))
            .map(|p| format!(".{p}.{name}"))
            .collect();
        for (path, p) in named_parameters(model, &Names::new().keep_duplicates()) {
            let path = format!(".{path}.");
            let bias = expected
                .iter()
                .any(|(_, _, b, base)| *base && b.same_as(&p));
            if bias || parts.iter().any(|part| path.contains(&format!("{part}."))) {
                p.set_requires_grad(false);
            }
        }
    }
    Ok(paths)
}
