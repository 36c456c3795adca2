//! What a load that does not fit suggests: a prefix rule that fixes most keys at once, "did you
//! mean" pairs that respect shapes and index offsets, and the grouping that keeps long reports
//! readable (`encoder.layer.{0..11}.attention.self.query.weight`).
//!
//! All of it runs only when a load found missing or unexpected keys, never on a load that fits.

use std::collections::{HashMap, HashSet};

use candle_core::Shape;

use crate::key_groups::numbered;
use crate::lazy_shape::LazyShape;
use crate::{KeyFix, KeyRule};

/// What a model slot takes: its shape, or for an unbuilt lazy slot the shapes its layout accepts.
pub enum Expected {
    Shape(Shape),
    Lazy(LazyShape),
}

/// What a slot takes, from its lazy shape (when unbuilt) or its shape.
pub fn expected(lazy: Option<LazyShape>, shape: Shape) -> Expected {
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

/// Everything a failed or partial load suggests.
pub struct Suggestions {
    pub fix: Option<KeyFix>,
    pub pairs: Vec<(String, String)>,
}

/// Finds a prefix fix, then pairs the keys it does not explain.
///
/// `model_keys` are every model path; `missing` and `unexpected` are in report order.
/// `given` are the load's own key rules, already applied to `unexpected`.
pub fn suggest(
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
    let fix = prefix_fix(model_keys, missing, unexpected)
        .map(|fix| KeyFix::new(fix.rules, fix.fixes, given.to_vec()));
    let (missing, unexpected): (Vec<_>, Vec<_>) = match &fix {
        Some(fix) => {
            let filled: HashSet<String> = unexpected.iter().map(|(u, _)| fix.map_key(u)).collect();
            let missing_set: HashSet<&str> = missing.iter().map(|(m, _)| m.as_str()).collect();
            (
                missing
                    .iter()
                    .filter(|(m, _)| !filled.contains(m))
                    .collect(),
                unexpected
                    .iter()
                    .filter(|(u, _)| !missing_set.contains(fix.map_key(u).as_str()))
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
        // Simulate the load with the rules: how many model keys would receive a value.
        let mut hit = HashSet::new();
        let mut explained = 0;
        for (u, shape) in unexpected {
            let mapped = KeyRule::apply_all(&rules, u);
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
            let mapped = KeyRule::apply_all(&rules, k);
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
            best = Some(KeyFix::new(rules, fixes, Vec::new()));
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

#[cfg(test)]
mod tests {
    use super::*;

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
