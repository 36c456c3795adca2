//! What a load found: [`LoadReport`], the payload of [`Error::Load`](crate::Error::Load).

use std::fmt;

use candle_core::{DType, Shape};

use crate::key_groups::{common_prefix, group_keys, group_pairs, Group};
use crate::key_rule::{KeyFix, KeyRule};
use crate::lazy_shape::LazyShape;

/// One entry whose value does not fit the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// The model path.
    pub key: String,
    /// The model's shape.
    pub expected_shape: Shape,
    /// The model's dtype.
    pub expected_dtype: DType,
    /// The checkpoint's shape.
    pub shape: Shape,
    /// The checkpoint's dtype.
    pub dtype: DType,
    /// For an unbuilt lazy parameter or buffer: the shapes it takes (`?` for any size);
    /// `expected_shape` is then its empty placeholder's.
    pub unbuilt: Option<LazyShape>,
}

/// Everything a load found: what it loaded, and every key that did not fit, all at once.
///
/// A failed load returns this inside [`Error::Load`](crate::Error::Load); a successful non-strict load returns it so the
/// caller can inspect what was skipped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Model paths the checkpoint has no value for.
    pub missing: Vec<String>,
    /// Checkpoint keys (after key rules) that name nothing in the model.
    pub unexpected: Vec<String>,
    /// Entries with the wrong shape or dtype.
    pub mismatched: Vec<Mismatch>,
    /// `(missing, unexpected)` pairs that look like the same entry under two spellings (or two
    /// numberings): the checkpoint's value fits the model's slot. Keys that
    /// [`key_fix`](Self::key_fix) explains are not paired.
    pub suggestions: Vec<(String, String)>,
    /// A prefix rule that would fill most missing keys at once (`module.` from `DataParallel`,
    /// a `bert.` the checkpoint has or lacks).
    pub key_fix: Option<KeyFix>,
    /// How many model entries received a value.
    pub loaded: usize,
    /// What each load transform (split, concatenation, transpose) and load pre-hook did, in the
    /// order they ran.
    pub transforms: Vec<TransformReport>,
}

/// What one load transform or load pre-hook did: the checkpoint keys it took and the keys it made
/// of them (a split: one key consumed, several produced; a concatenation: the reverse).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransformReport {
    /// The rule as code (`split("in_proj_weight", 0, ["q.weight", "k.weight", "v.weight"])`),
    /// or `load_state_dict pre-hook on "path"`.
    pub rule: String,
    /// The keys it took, in order (nothing for a rule that matched no key, in a non-strict load).
    pub consumed: Vec<String>,
    /// The keys it made, in order.
    pub produced: Vec<String>,
}

impl LoadReport {
    /// Whether every model entry was loaded and nothing was left over.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.mismatched.is_empty()
    }
}

/// At most this many patterns are listed for the missing or the unexpected keys; the rest are
/// counted.
const MAX_PATTERNS: usize = 6;
/// At most this many lines of mismatches, and of "did you mean" pairs.
const MAX_LINES: usize = 8;

/// PyTorch's `load_state_dict` error lists every key, which for a checkpoint with a stray
/// prefix is every key of the model twice. Here: a prefix rule, if one fixes most keys, in one
/// line; then keys that differ only in layer numbers as one pattern
/// (`encoder.layer.{0..11}.attention.self.query.weight`, `a..b` inclusive as in a shell), at most a
/// few patterns per kind with the rest counted (`and 180 more under "encoder.layer.*"`).
impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut missing: Vec<&str> = self.missing.iter().map(String::as_str).collect();
        let mut unexpected: Vec<&str> = self.unexpected.iter().map(String::as_str).collect();
        let mut other = "";
        if let Some(fix) = &self.key_fix {
            writeln!(f, "  {}", fix_line(fix, self.missing.len()))?;
            // The rest: what the rule leaves unexplained.
            let filled: std::collections::HashSet<String> =
                unexpected.iter().map(|u| fix.map_key(u)).collect();
            let wanted: std::collections::HashSet<&str> = missing.iter().copied().collect();
            unexpected.retain(|u| !wanted.contains(fix.map_key(u).as_str()));
            missing.retain(|m| !filled.contains(*m));
            other = "other ";
        }
        if !missing.is_empty() {
            write_keys(f, &format!("{other}missing key(s)"), &missing)?;
        }
        if !unexpected.is_empty() {
            write_keys(f, &format!("{other}unexpected key(s)"), &unexpected)?;
        }
        write_mismatches(f, &self.mismatched)?;
        write_suggestions(f, &self.suggestions)
    }
}

/// The one line that names the prefix rule.
fn fix_line(fix: &KeyFix, missing: usize) -> String {
    let (strip, add) = fix.rules.iter().fold((None, None), |(s, a), r| match r {
        KeyRule::StripPrefix(p) => (Some(p.trim_end_matches('.')), a),
        KeyRule::AddPrefix(p) => (s, Some(p.trim_end_matches('.'))),
        KeyRule::Rename(..) | KeyRule::RenameKey(..) => (s, a),
    });
    let what = match (strip, add) {
        (Some(s), Some(a)) => {
            format!(
                "the checkpoint's keys start with \"{s}.\" where the model's start with \"{a}.\""
            )
        }
        (Some(s), None) => {
            format!("the checkpoint's keys start with \"{s}.\" and the model's do not")
        }
        (None, Some(a)) => {
            format!("the model's keys start with \"{a}.\" and the checkpoint's do not")
        }
        (None, None) => String::from("the keys differ by a prefix"),
    };
    let share = if fix.fixes == missing {
        format!("all {missing}")
    } else {
        format!("{} of the {missing}", fix.fixes)
    };
    format!(
        "{what}: load with `{}` (it fills {share} missing keys).",
        fix.options_code()
    )
}

/// `  missing key(s): "a", "b".`, or for a long or numbered list
/// `  144 missing key(s): "encoder.layer.{0..11}.attention.self.query.weight" (12), …, and 60 more under "encoder.layer.*".`
fn write_keys(f: &mut fmt::Formatter<'_>, label: &str, keys: &[&str]) -> fmt::Result {
    let groups = group_keys(keys.iter().copied());
    if groups.iter().all(|g| g.count == 1) && groups.len() <= MAX_PATTERNS {
        let quoted: Vec<String> = keys.iter().map(|k| format!("\"{k}\"")).collect();
        return writeln!(f, "  {label}: {}.", quoted.join(", "));
    }
    let shown = groups.len().min(MAX_PATTERNS);
    let mut parts: Vec<String> = groups[..shown]
        .iter()
        .map(|g| match g.count {
            1 => format!("\"{}\"", g.pattern),
            n => format!("\"{}\" ({n})", g.pattern),
        })
        .collect();
    if let Some(rest) = more(&groups[shown..]) {
        parts.push(rest);
    }
    writeln!(f, "  {} {label}: {}.", keys.len(), parts.join(", "))
}

/// `and 60 more under "encoder.layer.*"` for the groups not shown.
fn more(hidden: &[Group]) -> Option<String> {
    if hidden.is_empty() {
        return None;
    }
    let count: usize = hidden.iter().map(|g| g.count).sum();
    // The patterns' leading segments are their keys' (a numbered one reads `layer.{6..11}`).
    let under = common_prefix(hidden.iter().map(|g| g.pattern.as_str()));
    Some(match under {
        Some(prefix) => format!("and {count} more under \"{prefix}\""),
        None => format!("and {count} more"),
    })
}

fn write_mismatches(f: &mut fmt::Formatter<'_>, mismatched: &[Mismatch]) -> fmt::Result {
    // Mismatches of one kind (same shapes and dtypes) group like keys do.
    let describe = |m: &Mismatch| {
        let expected = match &m.unbuilt {
            Some(shape) => format!("{shape} (unbuilt)"),
            None => format!("{:?}", m.expected_shape),
        };
        format!(
            "the checkpoint has {:?} {:?}, the model has {:?} {}",
            m.dtype, m.shape, m.expected_dtype, expected
        )
    };
    let mut kinds: Vec<(String, Vec<&str>)> = Vec::new();
    for m in mismatched {
        let d = describe(m);
        match kinds.iter_mut().find(|(k, _)| *k == d) {
            Some((_, keys)) => keys.push(&m.key),
            None => kinds.push((d, vec![&m.key])),
        }
    }
    let mut lines: Vec<(usize, String, usize)> = Vec::new();
    for (kind, keys) in &kinds {
        for g in group_keys(keys.iter().copied()) {
            let first = mismatched
                .iter()
                .position(|m| m.key == keys[g.first])
                .unwrap_or(0);
            let count = match g.count {
                1 => String::new(),
                n => format!(" ({n})"),
            };
            lines.push((first, format!("\"{}\"{count}: {kind}.", g.pattern), g.count));
        }
    }
    lines.sort_by_key(|l| l.0);
    for (_, line, _) in lines.iter().take(MAX_LINES) {
        writeln!(f, "  {line}")?;
    }
    if lines.len() > MAX_LINES {
        let count: usize = lines[MAX_LINES..].iter().map(|l| l.2).sum();
        writeln!(f, "  and {count} more mismatched key(s).")?;
    }
    Ok(())
}

fn write_suggestions(f: &mut fmt::Formatter<'_>, pairs: &[(String, String)]) -> fmt::Result {
    let groups = group_pairs(pairs);
    for g in groups.iter().take(MAX_LINES) {
        let (missing, unexpected) = g.pattern.split_once('\u{0}').unwrap_or((&g.pattern, ""));
        writeln!(
            f,
            "  did you mean: \"{unexpected}\" in the checkpoint for \"{missing}\" in the model?"
        )?;
    }
    if groups.len() > MAX_LINES {
        let count: usize = groups[MAX_LINES..].iter().map(|g| g.count).sum();
        writeln!(f, "  and {count} more \"did you mean\" pair(s).")?;
    }
    Ok(())
}
