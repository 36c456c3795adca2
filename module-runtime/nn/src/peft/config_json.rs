//! `adapter_config.json` field by field: every field PEFT's `LoraConfig` writes, each read into
//! [`LoraConfig`] or checked to hold the value that means "off"; anything else is refused with
//! the field's name.

use serde_json::{json, Map, Value};

use super::config::{invalid_type, InitLoraWeights, LoraBias, LoraConfig, TargetModules};
use crate::error::Result;
use module_core::PeftError;

/// Fields that say nothing about the computation (provenance, bookkeeping): read and dropped.
const INFORMATIONAL: &[&str] = &[
    "auto_mapping",
    "revision",
    "peft_version",
    "inference_mode",
    "megatron_core",
    "qalora_group_size",
    "runtime_config",
];

/// Fields of features this runtime does not implement: accepted only with the value that turns
/// them off (`null`, `false`, `{}`, `[]`).
const OFF_ONLY: &[&str] = &[
    "fan_in_fan_out",
    "layers_to_transform",
    "layers_pattern",
    "megatron_config",
    "trainable_token_indices",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "velora_config",
    "alora_invocation_tokens",
    "use_qalora",
    "monteclora_config",
    "layer_replication",
    "lora_bias",
    "target_parameters",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "ensure_weight_tying",
];

/// Fields read into [`LoraConfig`].
const READ: &[&str] = &[
    "peft_type",
    "task_type",
    "base_model_name_or_path",
    "r",
    "target_modules",
    "exclude_modules",
    "lora_alpha",
    "lora_dropout",
    "bias",
    "use_rslora",
    "init_lora_weights",
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "modules_to_save",
];

fn is_off(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Object(map) => map.is_empty(),
        Value::Array(items) => items.is_empty(),
        _ => false,
    }
}

fn unsupported(field: &str, value: &Value, reason: &str) -> crate::Error {
    PeftError::Unsupported {
        field: field.to_owned(),
        value: value.to_string(),
        reason: reason.to_owned(),
    }
    .into()
}

/// The configuration in `fields`, strictly.
pub(crate) fn parse(fields: &Map<String, Value>) -> Result<LoraConfig> {
    for (field, value) in fields {
        let field = field.as_str();
        if READ.contains(&field) || INFORMATIONAL.contains(&field) {
            continue;
        }
        if OFF_ONLY.contains(&field) {
            if !is_off(value) {
                return Err(unsupported(
                    field,
                    value,
                    "this runtime implements LoRA and DoRA only",
                ));
            }
            continue;
        }
        return Err(PeftError::UnknownField {
            field: field.to_owned(),
            file: None,
        }
        .into());
    }
    let get = |field: &str| fields.get(field).filter(|v| !v.is_null());
    match get("peft_type") {
        Some(Value::String(t)) if t == "LORA" => {}
        Some(other) => return Err(unsupported("peft_type", other, "only \"LORA\" adapters")),
        None => return Err(invalid_type("peft_type", "\"LORA\"")),
    }
    let Some(targets) = get("target_modules") else {
        return Err(PeftError::InvalidConfig {
            field: "target_modules".into(),
            message: "missing: name the modules to adapt".into(),
        }
        .into());
    };
    let mut config = LoraConfig::new(targets_of("target_modules", targets)?);
    if let Some(v) = get("r") {
        config.r = uint(v, "r")?;
    }
    if let Some(v) = get("lora_alpha") {
        config.lora_alpha = float(v, "lora_alpha")?;
    }
    if let Some(v) = get("lora_dropout") {
        config.lora_dropout = float(v, "lora_dropout")?;
    }
    if let Some(v) = get("exclude_modules") {
        config.exclude_modules = Some(targets_of("exclude_modules", v)?);
    }
    config.use_dora = flag(get("use_dora"), "use_dora")?;
    config.use_rslora = flag(get("use_rslora"), "use_rslora")?;
    if let Some(v) = get("bias") {
        config.bias = match v.as_str() {
            Some("none") => LoraBias::None,
            Some("all") => LoraBias::All,
            Some("lora_only") => LoraBias::LoraOnly,
            _ => return Err(invalid_type("bias", "\"none\", \"all\" or \"lora_only\"")),
        };
    }
    if let Some(v) = get("init_lora_weights") {
        config.init_lora_weights = match v {
            Value::Bool(true) => InitLoraWeights::Default,
            Value::Bool(false) => InitLoraWeights::Random,
            Value::String(s) if s == "gaussian" => InitLoraWeights::Gaussian,
            other => {
                return Err(unsupported(
                    "init_lora_weights",
                    other,
                    "true, false and \"gaussian\" are implemented",
                ))
            }
        };
    }
    if let Some(v) = get("modules_to_save") {
        let Value::Array(items) = v else {
            return Err(invalid_type("modules_to_save", "a list of module names"));
        };
        let names = items.iter().map(|v| text(v, "modules_to_save"));
        config.modules_to_save = Some(names.collect::<Result<_>>()?);
    }
    config.rank_pattern = pattern_map(get("rank_pattern"), "rank_pattern", uint)?;
    config.alpha_pattern = pattern_map(get("alpha_pattern"), "alpha_pattern", float)?;
    config.task_type = get("task_type").map(|v| text(v, "task_type")).transpose()?;
    config.base_model_name_or_path = get("base_model_name_or_path")
        .map(|v| text(v, "base_model_name_or_path"))
        .transpose()?;
    Ok(config)
}

fn targets_of(field: &str, value: &Value) -> Result<TargetModules> {
    match value {
        Value::String(re) => Ok(TargetModules::Regex(re.clone())),
        Value::Array(items) => items
            .iter()
            .map(|v| text(v, field))
            .collect::<Result<Vec<_>>>()
            .map(TargetModules::Names),
        _ => Err(invalid_type(field, "a list of module names or a regex")),
    }
}

fn uint(v: &Value, field: &str) -> Result<usize> {
    v.as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| invalid_type(field, "a non-negative integer"))
}

fn float(v: &Value, field: &str) -> Result<f64> {
    v.as_f64().ok_or_else(|| invalid_type(field, "a number"))
}

fn text(v: &Value, field: &str) -> Result<String> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| invalid_type(field, "a string"))
}

fn flag(v: Option<&Value>, field: &str) -> Result<bool> {
    match v {
        None => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| invalid_type(field, "true or false")),
    }
}

fn pattern_map<T>(
    v: Option<&Value>,
    field: &str,
    value: fn(&Value, &str) -> Result<T>,
) -> Result<Vec<(String, T)>> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| Ok((k.clone(), value(v, field)?)))
            .collect(),
        Some(_) => Err(invalid_type(field, "an object")),
    }
}

/// A number as PEFT writes it: an integer where it is one (`lora_alpha: 16`).
fn number(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        json!(x as i64)
    } else {
        json!(x)
    }
}

/// The configuration as PEFT writes it: every field of PEFT's `LoraConfig`, the features this
/// runtime does not implement off.
pub(crate) fn write(config: &LoraConfig) -> Map<String, Value> {
    let mut out = Map::new();
    let mut put = |k: &str, v: Value| {
        out.insert(k.to_owned(), v);
    };
    put(
        "alpha_pattern",
        Value::Object(
            config
                .alpha_pattern
                .iter()
                .map(|(k, a)| (k.clone(), number(*a)))
                .collect(),
        ),
    );
    put("auto_mapping", Value::Null);
    put(
        "base_model_name_or_path",
        json!(config.base_model_name_or_path),
    );
    put(
        "bias",
        json!(match config.bias {
            LoraBias::None => "none",
            LoraBias::All => "all",
            LoraBias::LoraOnly => "lora_only",
        }),
    );
    put(
        "exclude_modules",
        config
            .exclude_modules
            .as_ref()
            .map_or(Value::Null, TargetModules::to_json),
    );
    put("fan_in_fan_out", json!(false));
    put("inference_mode", json!(true));
    put(
        "init_lora_weights",
        match config.init_lora_weights {
            InitLoraWeights::Default => json!(true),
            InitLoraWeights::Random => json!(false),
            InitLoraWeights::Gaussian => json!("gaussian"),
        },
    );
    put("layers_pattern", Value::Null);
    put("layers_to_transform", Value::Null);
    put("lora_alpha", number(config.lora_alpha));
    put("lora_bias", json!(false));
    put("lora_dropout", json!(config.lora_dropout));
    put("modules_to_save", json!(config.modules_to_save));
    put("peft_type", json!("LORA"));
    put("r", json!(config.r));
    put(
        "rank_pattern",
        Value::Object(
            config
                .rank_pattern
                .iter()
                .map(|(k, r)| (k.clone(), json!(r)))
                .collect(),
        ),
    );
    put("revision", Value::Null);
    put("target_modules", config.target_modules.to_json());
    put("task_type", json!(config.task_type));
    put("use_dora", json!(config.use_dora));
    put("use_rslora", json!(config.use_rslora));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_config_reads_back() -> Result<()> {
        let config = LoraConfig {
            r: 4,
            lora_alpha: 6.5,
            use_dora: true,
            rank_pattern: vec![("fc1".into(), 2)],
            ..LoraConfig::new(TargetModules::Patterns(vec!["**.q_proj".into()]))
        };
        let back = parse(&write(&config))?;
        assert_eq!(back.r, 4);
        assert_eq!(back.lora_alpha, 6.5);
        assert!(back.use_dora);
        assert_eq!(back.rank_pattern, config.rank_pattern);
        assert_eq!(
            back.target_modules,
            TargetModules::Regex("(?:[^.]+\\.)*q_proj".into())
        );
        Ok(())
    }

    #[test]
    fn off_features_are_refused_by_name() {
        let mut fields = write(&LoraConfig::new(TargetModules::names(["q"])));
        fields.insert("fan_in_fan_out".into(), json!(true));
        let err = parse(&fields).unwrap_err().to_string();
        assert!(err.contains("`fan_in_fan_out` = true"), "{err}");
        fields.insert("fan_in_fan_out".into(), json!(false));
        fields.insert("init_lora_weights".into(), json!("pissa"));
        let err = parse(&fields).unwrap_err().to_string();
        assert!(err.contains("`init_lora_weights` = \"pissa\""), "{err}");
    }
}
