//! [`LoraConfig`]: PEFT's `LoraConfig`, its fields by PEFT's names, read strictly from and written
//! to `adapter_config.json`.

use std::path::Path;

use regex::Regex;
use serde_json::{json, Map, Value};

use crate::error::Result;
use module_core::PathPattern;
use module_core::PeftError;

/// Which modules get an adapter: PEFT's `target_modules`, or this runtime's path patterns.
#[derive(Clone, Debug, PartialEq)]
pub enum TargetModules {
    /// PEFT's list of names: a module is targeted when its path is one of them or ends with
    /// `.name` (`["q_proj", "v_proj"]` targets `model.layers.3.self_attn.q_proj`).
    Names(Vec<String>),
    /// PEFT's single string: a regular expression the whole path must match (`re.fullmatch`).
    Regex(String),
    /// [`PathPattern`]s (`**.q_proj`, `model.layers.*.self_attn.*_proj`, `model.layers.*.mlp.*`):
    /// this runtime's way, saved in `adapter_config.json` as the equivalent regex.
    Patterns(Vec<String>),
}

impl TargetModules {
    /// PEFT's list of names.
    pub fn names<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Self::Names(names.into_iter().map(Into::into).collect())
    }

    /// The matcher for module paths; a regex or pattern that does not compile is a typed error
    /// naming `field`.
    pub(crate) fn matcher(&self, field: &str) -> Result<Matcher> {
        let invalid = |message: String| PeftError::InvalidConfig {
            field: field.to_owned(),
            message,
        };
        Ok(match self {
            Self::Names(names) => Matcher::Names(names.clone()),
            Self::Regex(re) => Matcher::Regex(
                Regex::new(&format!("^(?:{re})$")).map_err(|e| invalid(e.to_string()))?,
            ),
            Self::Patterns(patterns) => Matcher::Patterns(
                patterns
                    .iter()
                    .map(|p| PathPattern::new(p))
                    .collect::<Result<_>>()?,
            ),
        })
    }

    /// The value `adapter_config.json` holds: the list, the regex, or the patterns as one regex
    /// (`*` one segment, `**` any number).
    pub(crate) fn to_json(&self) -> Value {
        match self {
            Self::Names(names) => json!(names),
            Self::Regex(re) => json!(re),
            Self::Patterns(patterns) => {
                let alternatives: Vec<String> = patterns.iter().map(|p| pattern_regex(p)).collect();
                json!(alternatives.join("|"))
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Names(names) => format!("{names:?}"),
            Self::Regex(re) => format!("{re:?}"),
            Self::Patterns(patterns) => format!("{patterns:?}"),
        }
    }
}

/// A path pattern as a regex: segments escaped, `*` one segment, `**` any number of them.
fn pattern_regex(pattern: &str) -> String {
    let parts: Vec<String> = pattern
        .split('.')
        .map(|segment| match segment {
            "**" => "(?:[^.]+(?:\\.[^.]+)*)?".to_owned(),
            _ => regex::escape(segment).replace("\\*", "[^.]*"),
        })
        .collect();
    parts
        .join("\\.")
        .replace("(?:[^.]+(?:\\.[^.]+)*)?\\.", "(?:[^.]+\\.)*")
}

/// A compiled [`TargetModules`].
pub(crate) enum Matcher {
    Names(Vec<String>),
    Regex(Regex),
    Patterns(Vec<PathPattern>),
}

impl Matcher {
    pub(crate) fn matches(&self, path: &str) -> bool {
        match self {
            Self::Names(names) => names
                .iter()
                .any(|n| path == n || path.ends_with(&format!(".{n}"))),
            Self::Regex(re) => re.is_match(path),
            Self::Patterns(patterns) => patterns.iter().any(|p| p.matches(path)),
        }
    }
}

/// How the adapter's factors start: PEFT's `init_lora_weights`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InitLoraWeights {
    /// `true` (PEFT's default): `lora_A` as `nn.Linear`'s default (Kaiming-uniform), `lora_B`
    /// zero, so the adapted model starts as the base model.
    #[default]
    Default,
    /// `"gaussian"`: `lora_A` normal with standard deviation `1 / r`, `lora_B` zero.
    Gaussian,
    /// `false`: both factors as `nn.Linear`'s default init (the adapter changes the output from
    /// the start; for tests and debugging, as in PEFT).
    Random,
}

/// Which biases are trained with the adapter, and saved in its file: PEFT's `bias`.
///
/// PEFT's warning holds here too: with trained biases, disabling or unloading the adapter does
/// not give the base model back (the biases stay as trained).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LoraBias {
    /// `"none"` (PEFT's default): no bias is trained.
    #[default]
    None,
    /// `"all"`: every parameter whose path contains `bias`.
    All,
    /// `"lora_only"`: the biases of the layers that hold the adapter.
    LoraOnly,
}

/// A LoRA (or DoRA) adapter's configuration: PEFT's `LoraConfig`, field by field, with PEFT's
/// defaults (except `target_modules`, which PEFT guesses from a Transformers model's type and
/// this runtime requires).
///
/// ```
/// use module_runtime::nn::peft::{LoraConfig, TargetModules};
/// let config = LoraConfig {
///     r: 16,
///     lora_alpha: 32.0,
///     lora_dropout: 0.05,
///     use_dora: true,
///     ..LoraConfig::new(TargetModules::names(["q_proj", "v_proj"]))
/// };
/// assert_eq!(config.scaling_for("model.layers.0.self_attn.q_proj"), (16, 2.0));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The rank of the update `B A` (PEFT's default 8).
    pub r: usize,
    /// The scale's numerator: the update is scaled by `lora_alpha / r` (PEFT's default 8).
    pub lora_alpha: f64,
    /// Dropout on the adapter's input, in training (PEFT's default 0).
    pub lora_dropout: f64,
    /// The modules that get an adapter.
    pub target_modules: TargetModules,
    /// Modules left out even where `target_modules` matches (PEFT's `exclude_modules`).
    pub exclude_modules: Option<TargetModules>,
    /// DoRA: a trained magnitude per output row over the normalized adapted weight.
    pub use_dora: bool,
    /// rsLoRA's scale `lora_alpha / sqrt(r)` instead of `lora_alpha / r`.
    pub use_rslora: bool,
    /// How the factors start.
    pub init_lora_weights: InitLoraWeights,
    /// Which biases are trained.
    pub bias: LoraBias,
    /// Another rank for the modules whose path matches a key, PEFT's rule: the key as a regex
    /// matching the end of the path at a segment boundary (`fc1`, `layers\.0\..*`). The first
    /// matching key wins.
    pub rank_pattern: Vec<(String, usize)>,
    /// Another `lora_alpha` by the same rule.
    pub alpha_pattern: Vec<(String, f64)>,
    /// Modules trained whole beside the adapter (PEFT's `modules_to_save`, usually a classifier
    /// head): each module whose path ends with one of these strings (PEFT's rule, `str.endswith`)
    /// gets a trainable copy, used while the adapter is active and saved in its file. The
    /// module must be a `Linear`, `Embedding`, `Conv1d/2d/3d` or `LayerNorm`. As in PEFT, an
    /// entry matching no module is skipped (PEFT's classifier adapters list `"classifier"` and
    /// `"score"`); when none matches, it is an error.
    pub modules_to_save: Option<Vec<String>>,
    /// PEFT's `task_type` (`"CAUSAL_LM"`, …), kept for the saved config; it changes nothing here.
    pub task_type: Option<String>,
    /// PEFT's `base_model_name_or_path`, kept for the saved config.
    pub base_model_name_or_path: Option<String>,
}

impl LoraConfig {
    /// PEFT's defaults (`r = 8`, `lora_alpha = 8`, no dropout, LoRA's init) for `target_modules`.
    pub fn new(target_modules: TargetModules) -> Self {
        Self {
            r: 8,
            lora_alpha: 8.0,
            lora_dropout: 0.0,
            target_modules,
            exclude_modules: None,
            use_dora: false,
            use_rslora: false,
            init_lora_weights: InitLoraWeights::Default,
            bias: LoraBias::None,
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            modules_to_save: None,
            task_type: None,
            base_model_name_or_path: None,
        }
    }

    /// The rank and scale of the adapter on the module at `path`: `rank_pattern` and
    /// `alpha_pattern` applied, then `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA).
    pub fn scaling_for(&self, path: &str) -> (usize, f64) {
        let r = pattern_value(&self.rank_pattern, path).unwrap_or(self.r);
        let alpha = pattern_value(&self.alpha_pattern, path).unwrap_or(self.lora_alpha);
        let scaling = if self.use_rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        };
        (r, scaling)
    }

    /// Checks the values PEFT would refuse (a rank of 0, a dropout outside `[0, 1)`, patterns
    /// that do not compile).
    pub(crate) fn validate(&self) -> Result<()> {
        let invalid = |field: &str, message: String| -> crate::Error {
            PeftError::InvalidConfig {
                field: field.to_owned(),
                message,
            }
            .into()
        };
        if self.r == 0 {
            return Err(invalid("r", "the rank must be positive".into()));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(invalid(
                "lora_dropout",
                format!("{} is not in [0, 1)", self.lora_dropout),
            ));
        }
        self.target_modules.matcher("target_modules")?;
        if let Some(exclude) = &self.exclude_modules {
            exclude.matcher("exclude_modules")?;
        }
        for (field, keys) in [
            (
                "rank_pattern",
                self.rank_pattern.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            ),
            (
                "alpha_pattern",
                self.alpha_pattern.iter().map(|(k, _)| k).collect(),
            ),
        ] {
            for key in keys {
                pattern_regex_of(key).map_err(|e| invalid(field, format!("{key:?}: {e}")))?;
            }
        }
        if let Some((key, _)) = self.rank_pattern.iter().find(|(_, r)| *r == 0) {
            return Err(invalid(
                "rank_pattern",
                format!("{key:?}: the rank must be positive"),
            ));
        }
        Ok(())
    }

    /// Describes the targets for errors.
    pub(crate) fn targets_text(&self) -> String {
        self.target_modules.describe()
    }

    /// Reads `adapter_config.json` strictly: a field this runtime does not know is
    /// [`PeftError::UnknownField`], a known field with a value it does not implement (another
    /// PEFT type, `fan_in_fan_out`, LoftQ, …) is [`PeftError::Unsupported`],
    /// both naming the field.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| crate::Error::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| match e {
            crate::Error::Peft(PeftError::UnknownField { field, .. }) => PeftError::UnknownField {
                field,
                file: Some(path.to_owned()),
            }
            .into(),
            other => other,
        })
    }

    /// [`from_json_file`](Self::from_json_file) on the file's text.
    ///
    /// ```
    /// use module_runtime::nn::peft::LoraConfig;
    /// let config = LoraConfig::from_json_str(
    ///     r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}"#,
    /// )?;
    /// assert_eq!(config.r, 4);
    /// let err = LoraConfig::from_json_str(r#"{"peft_type": "LORA", "lora_magic": 1}"#).unwrap_err();
    /// assert!(err.to_string().contains("`lora_magic`"));
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| PeftError::InvalidConfig {
            field: "adapter_config.json".to_owned(),
            message: e.to_string(),
        })?;
        let Value::Object(fields) = value else {
            return Err(invalid_type("adapter_config.json", "an object"));
        };
        let config = crate::peft::config_json::parse(&fields)?;
        config.validate()?;
        Ok(config)
    }

    /// The configuration as `adapter_config.json` holds it, every field PEFT writes, so that
    /// `PeftModel.from_pretrained` reads it.
    pub fn to_json(&self) -> Map<String, Value> {
        crate::peft::config_json::write(self)
    }
}

/// PEFT's `get_pattern_key`: the first key whose regex matches the end of `path` at a segment
/// boundary.
fn pattern_value<T: Copy>(patterns: &[(String, T)], path: &str) -> Option<T> {
    patterns.iter().find_map(|(key, value)| {
        let re = pattern_regex_of(key).ok()?;
        re.is_match(path).then_some(*value)
    })
}

fn pattern_regex_of(key: &str) -> std::result::Result<Regex, regex::Error> {
    Regex::new(&format!(r"^(?:.*\.)?(?:{key})$"))
}

pub(crate) fn invalid_type(field: &str, expected: &str) -> crate::Error {
    PeftError::InvalidConfig {
        field: field.to_owned(),
        message: format!("expected {expected}"),
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_match_as_peft_does() -> Result<()> {
        let names = TargetModules::names(["q_proj", "fc1"]).matcher("t")?;
        assert!(names.matches("model.layers.0.attn.q_proj"));
        assert!(names.matches("fc1"));
        assert!(!names.matches("model.xq_proj"));
        let re = TargetModules::Regex(r".*\.(q_proj|fc1)|head".into()).matcher("t")?;
        assert!(re.matches("attn.q_proj") && re.matches("head"));
        assert!(!re.matches("lm_head") && !re.matches("attn.q_proj.x"));
        let patterns = TargetModules::Patterns(vec!["**.q_proj".into(), "mlp.*".into()]);
        let m = patterns.matcher("t")?;
        assert!(m.matches("attn.q_proj") && m.matches("mlp.fc1") && !m.matches("mlp.a.b"));
        // The saved regex targets what the patterns target.
        let Value::String(saved) = patterns.to_json() else {
            panic!()
        };
        let re = TargetModules::Regex(saved).matcher("t")?;
        for path in [
            "attn.q_proj",
            "a.b.q_proj",
            "q_proj",
            "mlp.fc1",
            "mlp.a.b",
            "x.mlp.fc1",
        ] {
            assert_eq!(re.matches(path), m.matches(path), "{path}");
        }
        // A glob inside a segment.
        let glob = TargetModules::Patterns(vec!["layers.*.attn.*_proj".into()]);
        let Value::String(saved) = glob.to_json() else {
            panic!()
        };
        let (re, m) = (
            TargetModules::Regex(saved).matcher("t")?,
            glob.matcher("t")?,
        );
        for path in [
            "layers.0.attn.q_proj",
            "layers.0.attn.proj",
            "layers.0.attn.q_proj.x",
            "layers.0.1.attn.q_proj",
        ] {
            assert_eq!(re.matches(path), m.matches(path), "{path}");
        }
        assert!(m.matches("layers.11.attn.o_proj"));
        Ok(())
    }

    #[test]
    fn rank_and_alpha_patterns_follow_peft() {
        let config = LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            rank_pattern: vec![("fc1".into(), 2)],
            alpha_pattern: vec![("layers\\.0\\..*".into(), 3.0)],
            ..LoraConfig::new(TargetModules::names(["fc1"]))
        };
        assert_eq!(config.scaling_for("mlp.fc1"), (2, 4.0));
        assert_eq!(config.scaling_for("mlp.xfc1"), (4, 2.0));
        assert_eq!(config.scaling_for("layers.0.q"), (4, 0.75));
        let rs = LoraConfig {
            use_rslora: true,
            ..config
        };
        assert_eq!(rs.scaling_for("q"), (4, 4.0));
    }
}
