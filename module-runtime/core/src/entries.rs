//! [`Entries`]: values by string key in insertion order, as a Python dict keeps them; what
//! `StateDict` and `ModuleDict` hold.

use std::collections::HashMap;

/// Values by string key in insertion order, with a Python dict's rules: a key inserted again
/// keeps its position and takes the new value; a removed key closes its gap. Lookups go through
/// an index, so a state dict of thousands of keys reads each in constant time.
///
/// ```
/// use module_core::entries::Entries;
/// let mut e = Entries::new();
/// e.insert("b".to_owned(), 1);
/// e.insert("a".to_owned(), 2);
/// assert_eq!(e.insert("b".to_owned(), 3), Some(1)); // replaced in place
/// assert_eq!(e.keys().collect::<Vec<_>>(), ["b", "a"]);
/// assert_eq!(e.remove("b"), Some(3));
/// assert_eq!(e.get("a"), Some(&2));
/// ```
#[derive(Clone, Debug)]
pub struct Entries<V> {
    entries: Vec<(String, V)>,
    index: HashMap<String, usize>,
}

/// The read accessors of a dict holding its values in an [`Entries`] field named `entries`, with
/// Python's dict names: `get`, `contains_key`, `len`, `is_empty`, `keys`, `iter`. `StateDict` and
/// `ModuleDict` answer them alike, so they are written once, here; `$value` is the values' type,
/// `$what` their name in the docs.
#[doc(hidden)]
#[macro_export]
macro_rules! dict_accessors {
    ($value:ty, $what:literal) => {
        #[doc = concat!("The ", $what, " under `key`.")]
        pub fn get(&self, key: &str) -> Option<&$value> {
            self.entries.get(key)
        }

        /// Whether `key` is present.
        pub fn contains_key(&self, key: &str) -> bool {
            self.entries.contains_key(key)
        }

        /// Number of entries.
        pub fn len(&self) -> usize {
            self.entries.len()
        }

        /// Whether there are no entries.
        pub fn is_empty(&self) -> bool {
            self.entries.is_empty()
        }

        /// The keys, in insertion order.
        pub fn keys(&self) -> impl Iterator<Item = &str> {
            self.entries.keys()
        }

        #[doc = concat!("`(key, ", $what, ")` pairs, in insertion order.")]
        pub fn iter(&self) -> impl Iterator<Item = (&str, &$value)> {
            self.entries.iter()
        }
    };
}

impl<V> Default for Entries<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> Entries<V> {
    /// No entries.
    pub fn new() -> Self {
        Self {
            entries: Vec::new(),
            index: HashMap::new(),
        }
    }

    /// Inserts `value` under `key`, returning the value it replaces (whose position it keeps).
    pub fn insert(&mut self, key: String, value: V) -> Option<V> {
        match self.index.get(&key) {
            Some(&i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
                None
            }
        }
    }

    /// Removes the value under `key`; the entries after it move up one place.
    pub fn remove(&mut self, key: &str) -> Option<V> {
        let i = self.index.remove(key)?;
        for (k, _) in &self.entries[i + 1..] {
            if let Some(at) = self.index.get_mut(k) {
                *at -= 1;
            }
        }
        Some(self.entries.remove(i).1)
    }

    /// The value under `key`.
    pub fn get(&self, key: &str) -> Option<&V> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The value under `key`, mutably.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        self.index.get(key).map(|&i| &mut self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// The values, in order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, v)| v)
    }

    /// `(key, value)` pairs, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// `(key, value)` pairs with the values mutable, in order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut V)> {
        self.entries.iter_mut().map(|(k, v)| (k.as_str(), v))
    }
}

impl<V> IntoIterator for Entries<V> {
    type Item = (String, V);
    type IntoIter = std::vec::IntoIter<(String, V)>;

    /// The entries, in order.
    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}
