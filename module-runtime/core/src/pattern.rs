//! Path patterns: `encoder.layer.*.attention`, `**.bias`, `decoder`.

use crate::error::{Error, Result};

/// A pattern over dotted module and parameter paths.
///
/// Segments are separated by `.`. In a segment, `*` matches any run of characters (so `*` alone is
/// any one segment, and `layer*` any segment starting with `layer`); a segment that is exactly `**`
/// matches any number of segments, none included. Everything else matches itself.
///
/// ```
/// use module_runtime::PathPattern;
/// let p = PathPattern::new("encoder.layer.*.attention")?;
/// assert!(p.matches("encoder.layer.3.attention"));
/// assert!(!p.matches("encoder.layer.3.attention.query"));
/// assert!(p.matches_at_or_above("encoder.layer.3.attention.query.weight"));
/// assert!(PathPattern::new("**.bias")?.matches("fc1.bias"));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathPattern {
    source: String,
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    AnyDepth,
    Glob(String),
}

impl PathPattern {
    /// Parses a pattern. Empty patterns and empty segments (`a..b`) are errors.
    pub fn new(pattern: &str) -> Result<Self> {
        let invalid = |reason| Error::InvalidPattern {
            pattern: pattern.to_owned(),
            reason,
        };
        if pattern.is_empty() {
            return Err(invalid("it is empty (use `**` to match everything)"));
        }
        let segments = pattern
            .split('.')
            .map(|s| match s {
                "" => Err(invalid("it has an empty segment")),
                "**" => Ok(Segment::AnyDepth),
                s if s.contains("**") => Err(invalid("`**` must be a whole segment")),
                s => Ok(Segment::Glob(s.to_owned())),
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            source: pattern.to_owned(),
            segments,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether the pattern matches the whole of `path`.
    pub fn matches(&self, path: &str) -> bool {
        let parts: Vec<&str> = split_path(path);
        match_from(&self.segments, &parts, false)
    }

    /// Whether the pattern matches `path` or a module above it: `encoder` selects
    /// `encoder.layer.0.weight`. This is how `freeze("encoder")` reaches every parameter inside.
    pub fn matches_at_or_above(&self, path: &str) -> bool {
        let parts: Vec<&str> = split_path(path);
        match_from(&self.segments, &parts, true)
    }
}

fn split_path(path: &str) -> Vec<&str> {
    if path.is_empty() {
        Vec::new()
    } else {
        path.split('.').collect()
    }
}

fn match_from(pattern: &[Segment], path: &[&str], prefix_ok: bool) -> bool {
    match pattern.split_first() {
        None => path.is_empty() || prefix_ok,
        Some((Segment::AnyDepth, rest)) => {
            (0..=path.len()).any(|skip| match_from(rest, &path[skip..], prefix_ok))
        }
        Some((Segment::Glob(glob), rest)) => match path.split_first() {
            Some((first, tail)) => glob_match(glob, first) && match_from(rest, tail, prefix_ok),
            None => false,
        },
    }
}

/// `*` matches any run of characters within one segment.
fn glob_match(glob: &str, text: &str) -> bool {
    let mut parts = glob.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let pieces: Vec<&str> = parts.collect();
    let Some((last, middle)) = pieces.split_last() else {
        return rest.is_empty();
    };
    for piece in middle {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathPattern {
        PathPattern::new(s).unwrap()
    }

    #[test]
    fn literal_and_star() {
        assert!(p("fc1.weight").matches("fc1.weight"));
        assert!(!p("fc1.weight").matches("fc1.bias"));
        assert!(p("fc1.*").matches("fc1.bias"));
        assert!(!p("fc1.*").matches("fc1"));
        assert!(!p("*").matches(""));
        assert!(p("layer*.weight").matches("layer12.weight"));
        assert!(!p("layer*.weight").matches("block1.weight"));
        assert!(p("*_proj").matches("q_proj"));
        assert!(p("a*b*c").matches("aXbYc"));
        assert!(!p("a*b*c").matches("aXbY"));
        assert!(p("a*a").matches("aa"));
        assert!(!p("a*a").matches("a"));
    }

    #[test]
    fn any_depth() {
        assert!(p("**.bias").matches("bias"));
        assert!(p("**.bias").matches("a.b.c.bias"));
        assert!(!p("**.bias").matches("a.bias.c"));
        assert!(p("**").matches(""));
        assert!(p("**").matches("a.b"));
        assert!(p("encoder.**.dense").matches("encoder.layer.0.output.dense"));
        assert!(p("encoder.**.dense").matches("encoder.dense"));
    }

    #[test]
    fn at_or_above() {
        assert!(p("encoder").matches_at_or_above("encoder.layer.0.weight"));
        assert!(!p("encoder").matches_at_or_above("encoders.weight"));
        assert!(p("encoder.*").matches_at_or_above("encoder.layer.0.weight"));
        assert!(!p("encoder.*").matches_at_or_above("encoder"));
    }

    #[test]
    fn invalid() {
        assert!(PathPattern::new("").is_err());
        assert!(PathPattern::new("a..b").is_err());
        assert!(PathPattern::new("a.**b").is_err());
    }
}
