//! What a load that does not fit suggests: a prefix rule that fixes most keys at once, "did you
//! mean" pairs that respect shapes and index offsets, and the grouping that keeps long reports
//! readable (`encoder.layer.{0..11}.attention.self.query.weight`).
//!
//! All of it runs only when a load found missing or unexpected keys, never on a load that fits.

use std::collections::{HashMap, HashSet};

use candle_core::Shape;

use crate::lazy_shape::LazyShape;
use crate::state::{KeyRule, LoadOptions};

/// What a model slot takes: its shape, or for an unbuilt lazy slot the shapes its layout accepts.
pub(crate) enum Expected {
    Shape(Shape),
    Lazy(LazyShape),
}

/// What a slot takes, from its lazy shape (when unbuilt) or its shape.
pub(crate) fn expected(lazy: Option<LazyShape>, shape: Shape) -> Expected {
    match lazy {
        Some(lazy) => Expected::Lazy(lazy),
        None => Expected::Shape(shape),
    }
}

impl Expected {
    fn fits(&self, shape: &Shape) -> bool {
        match self {
            Expected::Shape(s) => s == shape,
            Expected::Lazy(l) => l.accepts(shape.dims()),
        }
    }
}

/// A key rewrite that would make most keys of a failed load match: a checkpoint saved from
/// `nn.DataParallel` (`module.` on every key), a task model's checkpoint (`bert.`) loaded into the
/// bare model, or the other way round.
///
/// PyTorch reports such a checkpoint as every key missing and every key unexpected, and leaves
/// the fix (`torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")`) to the
/// user; here the report names the [`LoadOptions`] that load it.
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
            }
        }
        code
    }

    /// The options the fix's own rules make (without the load's rules).
    pub fn options(&self) -> LoadOptions {
        self.rules
            .iter()
            .fold(LoadOptions::default(), |o, r| o.rule(r.clone()))
    }
}

/// Everything a failed or partial load suggests.
pub(crate) struct Suggestions {
    pub(crate) fix: Option<KeyFix>,
    pub(crate) pairs: Vec<(String, String)>,
}

/// Finds a prefix fix, then pairs the keys it does not explain.
///
/// `model_keys` are every model path; `missing` and `unexpected` are in report order.
/// `given` are the load's own key rules, already applied to `unexpected`.
pub(crate) fn suggest(
    model_keys: &[&str],
    missing: &[(String, Expected)],
    unexpected: &[(String, Shape)],
    given: &[KeyRule],
) -> Suggestions {
    if missing.is_empty() || unexpected.is_empty() {
        return Suggestions {
            fix: None,
            pairs: Vec::new(),
        };
    }
    let fix = prefix_fix(model_keys, missing, unexpected).map(|fix| KeyFix {
        given: given.to_vec(),
        ..fix
    });
    let (missing, unexpected): (Vec<_>, Vec<_>) = match &fix {
        Some(fix) => {
            let options = fix.options();
            let filled: HashSet<String> =
                unexpected.iter().map(|(u, _)| options.map_key(u)).collect();
            let missing_set: HashSet<&str> = missing.iter().map(|(m, _)| m.as_str()).collect();
            (
                missing
                    .iter()
                    .filter(|(m, _)| !filled.contains(m))
                    .collect(),
                unexpected
                    .iter()
                    .filter(|(u, _)| !missing_set.contains(options.map_key(u).as_str()))
                    .collect(),
            )
        }
        None => (missing.iter().collect(), unexpected.iter().collect()),
    };
    Suggestions {
        fix,
        pairs: pairs(&missing, &unexpected),
    }
}

/// At most this many leading segments are tried as a prefix (`module.bert.` is two).
const MAX_PREFIX_SEGMENTS: usize = 3;

/// The prefix rule that fills the most missing keys (counting the keys that match now and would
/// not with the rule against it), if it fills most missing keys from most unexpected ones.
fn prefix_fix(
    model_keys: &[&str],
    missing: &[(String, Expected)],
    unexpected: &[(String, Shape)],
) -> Option<KeyFix> {
    // Every way to write a missing key as `prefix.rest` (the prefix may be empty).
    let mut by_rest: HashMap<&str, Vec<&str>> = HashMap::new();
    for (m, _) in missing {
        for (prefix, rest) in splits(m) {
            by_rest.entry(rest).or_default().push(prefix);
        }
    }
    // Every (checkpoint prefix, model prefix) pair that turns an unexpected key into a missing one.
    let mut votes: HashMap<(&str, &str), usize> = HashMap::new();
    for (u, _) in unexpected {
        for (from, rest) in splits(u) {
            for &to in by_rest.get(rest).into_iter().flatten() {
                // Prefixes that start alike (`encoder.layers.` for `encoder.layer.`) are a renamed
                // module inside the model, for the "did you mean" pairs, not a stray prefix.
                if from.split('.').next() != to.split('.').next() {
                    *votes.entry((from, to)).or_default() += 1;
                }
            }
        }
    }
    let mut candidates: Vec<_> = votes.into_iter().collect();
    // Most votes first, then the simplest rule (fewest segments), then by name for determinism.
    candidates.sort_by(|((fa, ta), va), ((fb, tb), vb)| {
        vb.cmp(va)
            .then_with(|| segments(fa, ta).cmp(&segments(fb, tb)))
            .then_with(|| (fa, ta).cmp(&(fb, tb)))
    });
    let model_set: HashSet<&str> = model_keys.iter().copied().collect();
    let expected_of: HashMap<&str, &Expected> =
        missing.iter().map(|(m, e)| (m.as_str(), e)).collect();
    let missing_set: HashSet<&str> = expected_of.keys().copied().collect();
    // The checkpoint keys that match a model key now are those model keys.
    let matched: Vec<&str> = model_keys
        .iter()
        .copied()
        .filter(|k| !missing_set.contains(k))
        .collect();
    let mut best: Option<KeyFix> = None;
    for ((from, to), votes) in candidates.into_iter().take(4) {
        if votes * 2 <= missing.len() {
            break;
        }
        let mut rules = Vec::new();
        if !from.is_empty() {
            rules.push(KeyRule::StripPrefix(from.to_owned()));
        }
        if !to.is_empty() {
            rules.push(KeyRule::AddPrefix(to.to_owned()));
        }
        let fix = KeyFix {
            rules,
            fixes: 0,
            given: Vec::new(),
        };
        let options = fix.options();
        // Simulate the load with the rules: how many model keys would receive a value.
        let mut hit = HashSet::new();
        let mut explained = 0;
        for (u, shape) in unexpected {
            let mapped = options.map_key(u);
            // A value that would land in a slot it does not fit fills nothing.
            let fits = match expected_of.get(mapped.as_str()) {
                Some(expected) => expected.fits(shape),
                None => model_set.contains(mapped.as_str()),
            };
            if fits {
                explained += 1;
                hit.insert(mapped);
            }
        }
        for k in &matched {
            let mapped = options.map_key(k);
            if model_set.contains(mapped.as_str()) {
                hit.insert(mapped);
            }
        }
        // "Most keys differ by this prefix": a strict majority of the missing keys are filled,
        // and a strict majority of the unexpected ones used.
        let Some(fixes) = hit.len().checked_sub(matched.len()) else {
            continue;
        };
        if fixes * 2 <= missing.len() || explained * 2 <= unexpected.len() {
            continue;
        }
        if best.as_ref().is_none_or(|b| fixes > b.fixes) {
            best = Some(KeyFix { fixes, ..fix });
        }
    }
    best
}

fn segments(from: &str, to: &str) -> usize {
    let count = |s: &str| {
        if s.is_empty() {
            0
        } else {
            s.split('.').count()
        }
    };
    count(from) + count(to)
}

/// `key` as `(prefix, rest)` for up to [`MAX_PREFIX_SEGMENTS`] leading segments, the empty
/// prefix first; `rest` is never empty.
fn splits(key: &str) -> impl Iterator<Item = (&str, &str)> {
    let dots = key
        .match_indices('.')
        .map(|(i, _)| i)
        .take(MAX_PREFIX_SEGMENTS);
    std::iter::once(("", key)).chain(dots.map(move |i| (&key[..i], &key[i + 1..])))
}

/// One "did you mean" candidate, ranked by [`Candidate::rank`].
struct Candidate {
    missing: usize,
    unexpected: usize,
    /// `Some(offsets)` when the keys differ only in their numbers (`slice2.0` and `slice2.4`).
    offsets: Option<Vec<i64>>,
    distance: usize,
}

/// Pairs each missing key with the unexpected key most like it, each key used at most once.
///
/// A pair's values must fit: a checkpoint tensor whose shape the slot does not take is never
/// suggested. Keys that differ only in their numbers (`slice2.0.weight` and `slice2.4.weight`, a
/// `Sequential` renumbered from 0 in the port) are preferred, and among those the offset most
/// pairs share; then keys close in spelling (a case change, a typo) or with the same leaf under a
/// renamed module.
fn pairs(
    missing: &[&(String, Expected)],
    unexpected: &[&(String, Shape)],
) -> Vec<(String, String)> {
    // Edit distances cost O(len²) each; beyond this many pairs only numbering is compared.
    const MAX_SPELLING_PAIRS: usize = 250_000;
    let spelling = missing.len() * unexpected.len() <= MAX_SPELLING_PAIRS;
    let unexpected_split: Vec<_> = unexpected.iter().map(|(u, _)| numbered(u)).collect();
    let mut candidates = Vec::new();
    let mut offset_votes: HashMap<Vec<i64>, usize> = HashMap::new();
    for (mi, (m, expected)) in missing.iter().map(|e| (&e.0, &e.1)).enumerate() {
        let (m_template, m_nums) = numbered(m);
        let m_lower = m.to_lowercase();
        for (ui, (u, shape)) in unexpected.iter().map(|e| (&e.0, &e.1)).enumerate() {
            if !expected.fits(shape) {
                continue;
            }
            let (u_template, u_nums) = &unexpected_split[ui];
            if !m_nums.is_empty() && *u_template == m_template && *u_nums != m_nums {
                let offsets: Vec<i64> = m_nums
                    .iter()
                    .zip(u_nums)
                    .map(|(a, b)| *b as i64 - *a as i64)
                    .collect();
                *offset_votes.entry(offsets.clone()).or_default() += 1;
                candidates.push(Candidate {
                    missing: mi,
                    unexpected: ui,
                    offsets: Some(offsets),
                    distance: 0,
                });
                continue;
            }
            if !spelling {
                continue;
            }
            let distance = strsim::levenshtein(&m_lower, &u.to_lowercase());
            let same_leaf = m.rsplit('.').next() == u.rsplit('.').next();
            if distance <= 3.max(m.len() / 5) || (same_leaf && distance <= m.len() / 2) {
                candidates.push(Candidate {
                    missing: mi,
                    unexpected: ui,
                    offsets: None,
                    distance,
                });
            }
        }
    }
    let rank = |c: &Candidate| match &c.offsets {
        // Numbering first: the offset most pairs share, then the smallest shift.
        Some(o) => (
            0,
            usize::MAX - offset_votes[o],
            o.iter().map(|d| d.unsigned_abs() as usize).sum(),
            c.missing,
        ),
        None => (1, c.distance, 0, c.missing),
    };
    candidates.sort_by_key(|c| (rank(c), c.unexpected));
    let mut taken_m = vec![false; missing.len()];
    let mut taken_u = vec![false; unexpected.len()];
    let mut chosen = Vec::new();
    for c in candidates {
        if !taken_m[c.missing] && !taken_u[c.unexpected] {
            taken_m[c.missing] = true;
            taken_u[c.unexpected] = true;
            chosen.push((c.missing, c.unexpected));
        }
    }
    chosen.sort();
    chosen
        .into_iter()
        .map(|(m, u)| (missing[m].0.clone(), unexpected[u].0.clone()))
        .collect()
}

/// Marks a number's place in a template.
const SLOT: char = '\u{1}';

/// `key` with every numeric segment replaced by [`SLOT`], and those numbers:
/// `encoder.layer.3.output` is (`encoder.layer.\u{1}.output`, `[3]`).
fn numbered(key: &str) -> (String, Vec<u64>) {
    let mut template = String::with_capacity(key.len());
    let mut nums = Vec::new();
    for (i, segment) in key.split('.').enumerate() {
        if i > 0 {
            template.push('.');
        }
        let canonical = !segment.is_empty()
            && segment.bytes().all(|b| b.is_ascii_digit())
            && (segment == "0" || !segment.starts_with('0'));
        match segment.parse::<u64>() {
            Ok(n) if canonical => {
                template.push(SLOT);
                nums.push(n);
            }
            _ => template.push_str(segment),
        }
    }
    (template, nums)
}

/// Several keys (or lines) shown as one pattern.
#[derive(Debug, PartialEq)]
pub(crate) struct Group {
    /// The keys in brace notation (`layer.{0..11}.weight`; `a..b` is inclusive, as in a shell).
    pub(crate) pattern: String,
    /// How many keys it stands for.
    pub(crate) count: usize,
    /// The index of its first item in the input.
    pub(crate) first: usize,
}

/// Groups keys that differ only in their numbers: `encoder.layer.{0..11}.attention.self.query.weight`.
/// Groups come in the order of their first key.
pub(crate) fn group_keys<'a>(keys: impl IntoIterator<Item = &'a str>) -> Vec<Group> {
    group(keys.into_iter().map(|k| {
        let (template, nums) = numbered(k);
        (template, nums)
    }))
}

/// Groups `(missing, unexpected)` pairs that differ only in numbers both keys share:
/// `("encoder.layer.{0..11}.ln.weight", "encoder.layer.{0..11}.LayerNorm.weight")`, as
/// `missing\u{0}unexpected` patterns.
pub(crate) fn group_pairs(pairs: &[(String, String)]) -> Vec<Group> {
    group(pairs.iter().map(|(m, u)| {
        let (tm, nm) = numbered(m);
        let (tu, nu) = numbered(u);
        if nm == nu {
            (format!("{tm}\u{0}{tu}"), nm)
        } else {
            // Different numbers on the two sides: a pair of its own.
            (format!("{m}\u{0}{u}"), Vec::new())
        }
    }))
}

/// Groups items by template; within a template, numbers that form a full grid
/// (`{0..11}` × `{0..2}`) become one group, others are split by their first varying number.
fn group(items: impl Iterator<Item = (String, Vec<u64>)>) -> Vec<Group> {
    let mut templates: Vec<(String, Vec<Row>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (i, (template, nums)) in items.enumerate() {
        match index.get(&template) {
            Some(&t) => templates[t].1.push((i, nums)),
            None => {
                index.insert(template.clone(), templates.len());
                templates.push((template, vec![(i, nums)]));
            }
        }
    }
    let mut out = Vec::new();
    for (template, mut rows) in templates {
        rows.sort_by(|a, b| a.1.cmp(&b.1));
        rows.dedup_by(|a, b| a.1 == b.1);
        grid(&template, &rows, &mut out);
    }
    out.sort_by_key(|g| g.first);
    out
}

/// One item of a template: its index in the input and its numbers.
type Row = (usize, Vec<u64>);

fn grid(template: &str, rows: &[Row], out: &mut Vec<Group>) {
    let width = rows[0].1.len();
    let sets: Vec<Vec<u64>> = (0..width)
        .map(|p| {
            let mut s: Vec<u64> = rows.iter().map(|r| r.1[p]).collect();
            s.sort_unstable();
            s.dedup();
            s
        })
        .collect();
    let cells = sets
        .iter()
        .try_fold(1usize, |acc, s| acc.checked_mul(s.len()));
    if cells == Some(rows.len()) {
        out.push(Group {
            pattern: render(template, &sets),
            count: rows.len(),
            first: rows.iter().map(|r| r.0).min().unwrap_or(0),
        });
        return;
    }
    // Not a full grid: split on the first number that varies, and group each part.
    let p = sets
        .iter()
        .position(|s| s.len() > 1)
        .expect("a single row is a grid");
    for v in &sets[p] {
        let part: Vec<_> = rows.iter().filter(|r| r.1[p] == *v).cloned().collect();
        grid(template, &part, out);
    }
}

/// Fills a template's slots with the sets; a template of a pair has its numbers twice.
fn render(template: &str, sets: &[Vec<u64>]) -> String {
    let mut out = String::with_capacity(template.len() + 8);
    let mut slot = 0;
    for c in template.chars() {
        if c == SLOT {
            out.push_str(&render_set(&sets[slot % sets.len()]));
            slot += 1;
        } else {
            out.push(c);
        }
    }
    out
}

/// `3`, `{0,1}`, `{0..11}`, `{0..3,7}`: runs of three or more as inclusive ranges (bash's brace
/// expansion reads them back).
fn render_set(set: &[u64]) -> String {
    if let [one] = set {
        return one.to_string();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < set.len() {
        let mut j = i;
        while j + 1 < set.len() && set[j + 1] == set[j] + 1 {
            j += 1;
        }
        if j - i >= 2 {
            parts.push(format!("{}..{}", set[i], set[j]));
        } else {
            parts.extend(set[i..=j].iter().map(u64::to_string));
        }
        i = j + 1;
    }
    format!("{{{}}}", parts.join(","))
}

/// The segments all `keys` share at their start, as `a.b.*`, or `None` when they share none.
pub(crate) fn common_prefix<'a>(keys: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let mut common: Option<Vec<&str>> = None;
    for key in keys {
        let segments = pattern_segments(key);
        // The last segment is the key's own name, never a prefix.
        let segments = &segments[..segments.len().saturating_sub(1)];
        common = Some(match common {
            None => segments.to_vec(),
            Some(c) => c
                .iter()
                .zip(segments)
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| *a)
                .collect(),
        });
    }
    common
        .filter(|c| !c.is_empty())
        .map(|c| format!("{}.*", c.join(".")))
}

/// A key or pattern's segments: dots inside braces (`{0..11}`) do not split.
fn pattern_segments(pattern: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in pattern.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            '.' if depth == 0 => {
                out.push(&pattern[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&pattern[start..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(keys: &[&str]) -> Vec<(String, usize)> {
        group_keys(keys.iter().copied())
            .into_iter()
            .map(|g| (g.pattern, g.count))
            .collect()
    }

    #[test]
    fn numbers_group_into_ranges() {
        let keys: Vec<String> = (0..12)
            .flat_map(|l| {
                [
                    format!("encoder.layer.{l}.attention.self.query.weight"),
                    format!("encoder.layer.{l}.attention.self.query.bias"),
                ]
            })
            .chain(["pooler.dense.weight".to_owned()])
            .collect();
        assert_eq!(
            patterns(&keys.iter().map(String::as_str).collect::<Vec<_>>()),
            [
                (
                    "encoder.layer.{0..11}.attention.self.query.weight".to_owned(),
                    12
                ),
                (
                    "encoder.layer.{0..11}.attention.self.query.bias".to_owned(),
                    12
                ),
                ("pooler.dense.weight".to_owned(), 1),
            ]
        );
    }

    #[test]
    fn sets_and_grids() {
        assert_eq!(
            patterns(&["a.0.w", "a.1.w", "a.3.w", "a.4.w", "a.5.w", "a.9.w"]),
            [("a.{0,1,3..5,9}.w".to_owned(), 6)]
        );
        assert_eq!(
            patterns(&["a.0.b.0", "a.0.b.1", "a.1.b.0", "a.1.b.1"]),
            [("a.{0,1}.b.{0,1}".to_owned(), 4)]
        );
        // Not a grid: split on the first number.
        assert_eq!(
            patterns(&["a.0.b.0", "a.0.b.1", "a.1.b.0"]),
            [("a.0.b.{0,1}".to_owned(), 2), ("a.1.b.0".to_owned(), 1)]
        );
        // Leading zeros are names, not numbers.
        assert_eq!(
            patterns(&["a.01", "a.1"]),
            [("a.01".to_owned(), 1), ("a.1".to_owned(), 1)]
        );
    }

    #[test]
    fn pairs_group_when_both_sides_share_the_numbers() {
        let pairs: Vec<(String, String)> = (0..3)
            .map(|l| {
                (
                    format!("h.{l}.ln.weight"),
                    format!("h.{l}.LayerNorm.weight"),
                )
            })
            .collect();
        let groups = group_pairs(&pairs);
        assert_eq!(groups.len(), 1);
        assert_eq!(
            groups[0].pattern,
            "h.{0..2}.ln.weight\u{0}h.{0..2}.LayerNorm.weight"
        );
    }

    #[test]
    fn common_prefixes() {
        assert_eq!(
            common_prefix(["encoder.layer.6.a.weight", "encoder.layer.11.b.bias"]),
            Some("encoder.layer.*".to_owned())
        );
        assert_eq!(common_prefix(["a.weight", "b.weight"]), None);
        assert_eq!(
            common_prefix(["h.{6..11}.ln.weight", "h.{6..11}.fc.bias"]),
            Some("h.{6..11}.*".to_owned())
        );
    }

    #[test]
    fn splits_try_short_prefixes() {
        let s: Vec<_> = splits("module.bert.embeddings.weight").collect();
        assert_eq!(
            s,
            [
                ("", "module.bert.embeddings.weight"),
                ("module", "bert.embeddings.weight"),
                ("module.bert", "embeddings.weight"),
                ("module.bert.embeddings", "weight"),
            ]
        );
    }
}
