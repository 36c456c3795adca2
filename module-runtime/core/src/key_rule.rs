//! Key rewrites: [`KeyRule`], applied to a checkpoint's keys before they are matched to the
//! model's paths, and [`KeyFix`], the rules a failed load suggests.

/// How a checkpoint's keys are rewritten before they are matched against the model's paths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyRule {
    /// Removes a leading `prefix.` where present (`module.` from `DataParallel`, `bert.`); the
    /// prefix may be given with or without its trailing dot.
    StripPrefix(String),
    /// Puts `prefix.` in front of every key; the prefix may be given with or without its
    /// trailing dot.
    AddPrefix(String),
    /// Replaces a run of whole path segments: `Rename("gamma", "weight")` turns `ln.gamma` into
    /// `ln.weight`, and leaves `ln.gammas` alone.
    Rename(String, String),
    /// Renames a whole key that matches the dotted pattern `from`, in which a `*` segment
    /// matches any one segment, to `to`, whose `*` segments take the matched ones in order:
    /// `RenameKey("blk.*.attn_q.weight", "model.layers.*.self_attn.q_proj.weight")` turns
    /// llama.cpp's `blk.3.attn_q.weight` into Hugging Face's
    /// `model.layers.3.self_attn.q_proj.weight`. A key that does not match is left alone.
    RenameKey(String, String),
}

impl KeyRule {
    /// The key `rules` make of `key`, applied in order: what a load matches against the model.
    pub fn apply_all(rules: &[KeyRule], key: &str) -> String {
        rules
            .iter()
            .fold(key.to_owned(), |key, rule| rule.apply(&key))
    }

    /// The key this rule makes of `key` (`key` itself where the rule does not apply).
    pub fn apply(&self, key: &str) -> String {
        match self {
            // `module` and `module.` are one prefix: PyTorch's
            // `consume_prefix_in_state_dict_if_present(sd, "module.")` is spelled with the dot.
            KeyRule::StripPrefix(prefix) => key
                .strip_prefix(prefix.trim_end_matches('.'))
                .and_then(|rest| rest.strip_prefix('.'))
                .unwrap_or(key)
                .to_owned(),
            KeyRule::AddPrefix(prefix) => match prefix.trim_end_matches('.') {
                "" => key.to_owned(),
                prefix => format!("{prefix}.{key}"),
            },
            KeyRule::RenameKey(from, to) => {
                rename_key(from, to, key).unwrap_or_else(|| key.to_owned())
            }
            KeyRule::Rename(from, to) => {
                let padded = format!(".{key}.");
                match padded.find(&format!(".{from}.")) {
                    Some(at) => {
                        let mut out = padded.clone();
                        out.replace_range(at + 1..at + 1 + from.len(), to);
                        out[1..out.len() - 1].to_owned()
                    }
                    None => key.to_owned(),
                }
            }
        }
    }
}

/// `key` renamed by the pattern `from` → `to` ([`KeyRule::RenameKey`]), if it matches.
fn rename_key(from: &str, to: &str, key: &str) -> Option<String> {
    let (pattern, parts): (Vec<&str>, Vec<&str>) =
        (from.split('.').collect(), key.split('.').collect());
    if pattern.len() != parts.len() {
        return None;
    }
    let mut captured = Vec::new();
    for (p, part) in pattern.iter().zip(&parts) {
        match *p {
            "*" => captured.push(*part),
            p if p == *part => {}
            _ => return None,
        }
    }
    let mut captured = captured.into_iter();
    let renamed: Vec<&str> = to
        .split('.')
        .map(|s| match s {
            "*" => captured.next().unwrap_or("*"),
            s => s,
        })
        .collect();
    Some(renamed.join("."))
}

/// A key rewrite that would make most keys of a failed load match: a checkpoint saved from
/// `nn.DataParallel` (`module.` on every key), a task model's checkpoint (`bert.`) loaded into the
/// bare model, or the other way round.
///
/// PyTorch reports such a checkpoint as every key missing and every key unexpected, and leaves
/// the fix (`torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")`) to the
/// user; here the report names the load options that load it (`LoadOptions::from(&fix)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyFix {
    /// The rules to add to the load's options, in order (a strip, an add, or a strip then an add).
    pub rules: Vec<KeyRule>,
    /// How many of the missing model keys the rules would fill.
    pub fixes: usize,
    /// The rules the load already had (they come first in [`options_code`](Self::options_code)).
    given: Vec<KeyRule>,
}

impl KeyFix {
    /// The options that load the checkpoint, as code: the load's own key rules, then the fix
    /// (`LoadOptions::default().strip_prefix("module")`).
    pub fn options_code(&self) -> String {
        let mut code = String::from("LoadOptions::default()");
        for rule in self.given.iter().chain(&self.rules) {
            match rule {
                KeyRule::StripPrefix(p) => code.push_str(&format!(".strip_prefix({p:?})")),
                KeyRule::AddPrefix(p) => code.push_str(&format!(".add_prefix({p:?})")),
                KeyRule::Rename(a, b) => code.push_str(&format!(".rename({a:?}, {b:?})")),
                KeyRule::RenameKey(a, b) => code.push_str(&format!(".rename_key({a:?}, {b:?})")),
            }
        }
        code
    }

    /// A fix of `rules` that fills `fixes` missing keys, for a load that had the rules `given`.
    #[doc(hidden)]
    pub fn new(rules: Vec<KeyRule>, fixes: usize, given: Vec<KeyRule>) -> Self {
        Self {
            rules,
            fixes,
            given,
        }
    }

    /// `key` rewritten by the fix's own rules, in order (without the load's rules).
    pub fn map_key(&self, key: &str) -> String {
        KeyRule::apply_all(&self.rules, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_key_matches_whole_keys_segment_by_segment() {
        let rule = KeyRule::RenameKey("blk.*.ffn_*.weight".into(), "layers.*.mlp.*.w".into());
        assert_eq!(rule.apply("blk.3.ffn_*.weight"), "layers.3.mlp.*.w");
        // `*` is a whole segment, not a glob inside one: `ffn_up` is not `ffn_*`.
        assert_eq!(rule.apply("blk.3.ffn_up.weight"), "blk.3.ffn_up.weight");
        let rule = KeyRule::RenameKey("blk.*.*.weight".into(), "layers.*.*.w".into());
        assert_eq!(rule.apply("blk.3.attn_q.weight"), "layers.3.attn_q.w");
        // Another number of segments, or another fixed segment: left alone.
        assert_eq!(rule.apply("blk.3.attn_q.weight.x"), "blk.3.attn_q.weight.x");
        assert_eq!(rule.apply("blk.3.attn_q.bias"), "blk.3.attn_q.bias");
        // Rules apply in order, each to the key the one before made.
        let rules = [
            KeyRule::RenameKey("token_embd.weight".into(), "embed.weight".into()),
            KeyRule::AddPrefix("model".into()),
        ];
        assert_eq!(
            KeyRule::apply_all(&rules, "token_embd.weight"),
            "model.embed.weight"
        );
    }

    #[test]
    fn a_fix_spells_rename_key_as_load_options_code() {
        let given = vec![KeyRule::RenameKey("a.*".into(), "b.*".into())];
        let fix = KeyFix::new(vec![KeyRule::StripPrefix("module".into())], 3, given);
        assert_eq!(
            fix.options_code(),
            r#"LoadOptions::default().rename_key("a.*", "b.*").strip_prefix("module")"#
        );
    }
}
