//! Typed paths: module paths the compiler checks and the editor completes.
//!
//! `#[module(paths)]` on a derived type makes the derive also emit a path type (`BertModelPath`
//! for `BertModel`) with one method per field, and `BertModel::path()`, the path of the root:
//!
//! ```
//! use module_runtime::nn::LayerNorm;
//! use module_runtime::prelude::*;
//!
//! #[derive(Module)]
//! #[module(paths)]
//! struct Block {
//!     #[module(rename = "LayerNorm")]
//!     norm: LayerNorm,
//!     fc: Linear,
//! }
//!
//! #[derive(Module)]
//! #[module(paths)]
//! struct Net {
//!     blocks: Vec<Block>,
//!     head: Option<Linear>,
//! }
//!
//! let dev = Device::Cpu;
//! let block = || -> Result<Block> {
//!     Ok(Block { norm: LayerNorm::new(4, &dev)?, fc: Linear::new(4, 4, &dev)? })
//! };
//! let net = Net { blocks: vec![block()?, block()?], head: None };
//!
//! // The string form is the state-dict path.
//! let norm = Net::path().blocks().at(1).norm();
//! assert_eq!(norm.as_str(), "blocks.1.LayerNorm");
//! // `get` gives the concrete type; an index is checked at run time, so it is an `Option`.
//! let norm: Option<&LayerNorm> = net.get(norm);
//! assert!(norm.is_some());
//! // A path with no index or `Option` on the way exists: `get` returns the module itself.
//! let blocks: &Vec<Block> = net.get(Net::path().blocks());
//! assert_eq!(blocks.len(), 2);
//! // `each()` is the wildcard `*`; `get` on a pattern lists every match.
//! let every_fc = Net::path().blocks().each().fc();
//! assert_eq!(every_fc.as_str(), "blocks.*.fc");
//! assert_eq!(net.get(every_fc.clone()).len(), 2);
//! // A typed path is a `str` wherever one is taken (hooks, `capture`, `freeze`).
//! assert_eq!(net.freeze(&every_fc)?, 4);
//! assert!(net.get(Net::path().head()).is_none());
//! // `get_mut` mirrors `get`: `&mut T`, `Option<&mut T>`, or every match at once.
//! let mut net = net;
//! for fc in net.get_mut(Net::path().blocks().each().fc()) {
//!     fc.bias = None;
//! }
//! assert!(net.blocks.iter().all(|b| b.fc.bias.is_none()));
//! # Ok::<(), module_runtime::Error>(())
//! ```
//!
//! The path types of the runtime's layers are in [`nn`](../module_runtime/nn/index.html) beside them
//! ([`nn::LinearPath`](../module_runtime/nn/struct.LinearPath.html), …). The rustdoc of a derived type lists its
//! `path()` function, whose return type links to the path type (`NetPath`), and the path type's
//! page lists every segment method: what rust-analyzer completes after `Net::path().`.
//!
//! A misspelled field is a compile error naming the path type (`NetPath`) and its methods; an
//! index into something that is not a list has no `at` method.
//!
//! What the string form follows: `rename`d fields use their checkpoint name; a `flatten`ed field adds
//! no segment (its path is its parent's, and [`get`](PathExt::get) is not offered on it, only on
//! its children); `Option`, `Box`, `Arc` and `Lazy` add none (`Option` and `Lazy` make the path
//! [`Checked`]); `Vec`, arrays, `ModuleList` and `Sequential` are indexed with `at(i)`, maps
//! (`BTreeMap<String, _>`, `ModuleDict`) with `key(k)`, tuples with `_0()`, `_1()`, …; an enum's
//! fields are reached through `<variant>_<field>()` (the variant name is no path segment), and a
//! single-field tuple variant, which is transparent, through `<variant>()`. A module shared
//! through `Arc` has one state-dict path (its first); a typed path through another alias reaches
//! the same module. A path through an `Arc` is of kind [`Shared`]: `get` works, `get_mut` does not
//! compile (a shared module has no `&mut`).

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;

use crate::module::{Child, ChildMut, Module};

mod sealed {
    pub trait Sealed {}
}

/// What is known at compile time about whether a typed path exists: its *kind*, a marker type
/// parameter of every path. [`PathExt::get`] returns `&T` for a [`Static`] path, `Option<&T>` for
/// a [`Checked`] one, and every match for an [`Each`] pattern.
pub trait PathKind: sealed::Sealed + 'static {
    /// The kind after a field segment.
    type Field: PathKind;
    /// The kind after something only known at run time (an index, an `Option`, an enum variant).
    type Checked: PathKind;
}

/// A path that exists in every value of the root type: only fields, `Box` and `Arc` on the way.
pub enum Static {}
/// A path whose existence is checked at run time: it goes through an index, a key, an `Option`,
/// a `Lazy` cell or an enum variant.
pub enum Checked {}
/// A pattern: it went through `each()` (`*`).
pub enum Each {}
/// The path of a `#[module(flatten)]` field: the same string as its parent's, so it is only a
/// prefix for the field's children (no [`get`](PathExt::get), which would find the parent).
pub struct Flat<K>(PhantomData<K>, std::convert::Infallible);
/// A path of kind `K` that went through an `Arc`: [`get`](PathExt::get) resolves it as `K`, but
/// [`get_mut`](PathExt::get_mut) is not offered, since a module shared through an `Arc` has no
/// `&mut` (reach it with `Arc::get_mut` or `Arc::make_mut` on the field instead).
pub struct Shared<K>(PhantomData<K>, std::convert::Infallible);

impl sealed::Sealed for Static {}
impl sealed::Sealed for Checked {}
impl sealed::Sealed for Each {}
impl<K> sealed::Sealed for Flat<K> {}
impl<K> sealed::Sealed for Shared<K> {}
impl PathKind for Static {
    type Field = Static;
    type Checked = Checked;
}
impl PathKind for Checked {
    type Field = Checked;
    type Checked = Checked;
}
impl PathKind for Each {
    type Field = Each;
    type Checked = Each;
}
impl<K: PathKind> PathKind for Flat<K> {
    type Field = K;
    type Checked = Flat<K::Checked>;
}
impl<K: PathKind> PathKind for Shared<K> {
    type Field = Shared<K::Field>;
    type Checked = Shared<K::Checked>;
}

/// The kind of a path after an index or a key.
pub type Indexed<K> = <<K as PathKind>::Field as PathKind>::Checked;

/// The kinds [`PathExt::get`] resolves, and what it returns for each.
pub trait Resolve: PathKind {
    /// `&T`, `Option<&T>` or `Vec<&T>`.
    type Output<'a, T: 'a>;
    #[doc(hidden)]
    fn __resolve<'a, T: Any>(root: &'a dyn Module, path: &str) -> Self::Output<'a, T>;
}

/// A `Static` path that found nothing: its type proved it exists, so this is a bug.
fn unresolved<T>(path: &str) -> ! {
    panic!(
        "the typed path `{path}` to a `{}` did not resolve, which its type rules out: a bug in \
         module-runtime or in a hand-written `Module` impl on the way",
        std::any::type_name::<T>()
    )
}

impl Resolve for Static {
    type Output<'a, T: 'a> = &'a T;
    fn __resolve<'a, T: Any>(root: &'a dyn Module, path: &str) -> &'a T {
        find(root, path, false)
            .into_iter()
            .next()
            .unwrap_or_else(|| unresolved::<T>(path))
    }
}

impl Resolve for Checked {
    type Output<'a, T: 'a> = Option<&'a T>;
    fn __resolve<'a, T: Any>(root: &'a dyn Module, path: &str) -> Option<&'a T> {
        find(root, path, false).into_iter().next()
    }
}

impl Resolve for Each {
    type Output<'a, T: 'a> = Vec<&'a T>;
    fn __resolve<'a, T: Any>(root: &'a dyn Module, path: &str) -> Vec<&'a T> {
        find(root, path, true)
    }
}

impl<K: Resolve> Resolve for Shared<K> {
    type Output<'a, T: 'a> = K::Output<'a, T>;
    fn __resolve<'a, T: Any>(root: &'a dyn Module, path: &str) -> Self::Output<'a, T> {
        K::__resolve::<T>(root, path)
    }
}

/// The kinds [`PathExt::get_mut`] resolves, and what it returns for each: all but the paths
/// through an `Arc` ([`Shared`]) and flattened fields' own paths ([`Flat`]).
#[diagnostic::on_unimplemented(
    message = "`get_mut` needs a path that owns its target, and this one is `{Self}`",
    label = "no `&mut` through this path",
    note = "a path through an `Arc` (kind `Shared<_>`) has no `&mut`: use `Arc::get_mut` or \
            `Arc::make_mut` on the `Arc` field; a flattened field's own path (`Flat<_>`) names its \
            parent: take `get_mut` of a child"
)]
pub trait ResolveMut: Resolve {
    /// `&mut T`, `Option<&mut T>` or `Vec<&mut T>`.
    type OutputMut<'a, T: 'a>;
    #[doc(hidden)]
    fn __resolve_mut<'a, T: Any>(root: &'a mut dyn Module, path: &str) -> Self::OutputMut<'a, T>;
}

impl ResolveMut for Static {
    type OutputMut<'a, T: 'a> = &'a mut T;
    fn __resolve_mut<'a, T: Any>(root: &'a mut dyn Module, path: &str) -> &'a mut T {
        find_mut(root, path, false)
            .into_iter()
            .next()
            .unwrap_or_else(|| unresolved::<T>(path))
    }
}

impl ResolveMut for Checked {
    type OutputMut<'a, T: 'a> = Option<&'a mut T>;
    fn __resolve_mut<'a, T: Any>(root: &'a mut dyn Module, path: &str) -> Option<&'a mut T> {
        find_mut(root, path, false).into_iter().next()
    }
}

impl ResolveMut for Each {
    type OutputMut<'a, T: 'a> = Vec<&'a mut T>;
    fn __resolve_mut<'a, T: Any>(root: &'a mut dyn Module, path: &str) -> Vec<&'a mut T> {
        find_mut(root, path, true)
    }
}

fn segments(path: &str) -> Vec<&str> {
    if path.is_empty() {
        Vec::new()
    } else {
        path.split('.').collect()
    }
}

/// Every node at `path` that is a `T`, mutably. The mutable walk hands out each child once, so
/// the matches are disjoint; a module shared through an `Arc` with other owners is no match
/// (typed paths through an `Arc` have no `get_mut`; this covers a layer of a `Sequential` only).
fn find_mut<'a, T: Any>(root: &'a mut dyn Module, path: &str, wildcards: bool) -> Vec<&'a mut T> {
    let mut found = Vec::new();
    walk_mut(
        ChildMut::Module(root),
        &segments(path),
        wildcards,
        &mut found,
    );
    found
}

fn walk_mut<'a, T: Any>(
    node: ChildMut<'a>,
    segments: &[&str],
    wildcards: bool,
    out: &mut Vec<&'a mut T>,
) {
    let Some((segment, rest)) = segments.split_first() else {
        let any: Option<&'a mut dyn Any> = match node {
            ChildMut::Module(module) => Some(module as &mut dyn Any),
            ChildMut::Param(p) => Some(p as &mut dyn Any),
            ChildMut::Buffer(b) => Some(b as &mut dyn Any),
            ChildMut::Shared(_) | ChildMut::Mode(_) | ChildMut::Absent => None,
        };
        out.extend(any.and_then(|a| a.downcast_mut::<T>()));
        return;
    };
    if let ChildMut::Module(module) = node {
        let mut first = true;
        let any = wildcards && *segment == "*";
        module.visit_children_mut(&mut |name, child| {
            if any || (first && name.matches(segment)) {
                first = any;
                walk_mut(child, rest, wildcards, out);
            }
        });
    }
}

/// Every node at `path` that is a `T`. With `wildcards` (a pattern, from `each()`), a `*` segment
/// matches any child; otherwise it is a name like any other, which no child has (a key with `*`
/// is refused where it enters), so `key("*")` is not a pattern in disguise.
fn find<'a, T: Any>(root: &'a dyn Module, path: &str, wildcards: bool) -> Vec<&'a T> {
    let root = Child::Module {
        module: root,
        shared: None,
    };
    let mut found = Vec::new();
    walk(root, &segments(path), wildcards, &mut found);
    found
}

fn walk<'a, T: Any>(node: Child<'a>, segments: &[&str], wildcards: bool, out: &mut Vec<&'a T>) {
    let Some((segment, rest)) = segments.split_first() else {
        let any: Option<&'a dyn Any> = match node {
            Child::Module { module, .. } => Some(module as &dyn Any),
            Child::Param(p) => Some(p as &dyn Any),
            Child::Buffer(b) => Some(b as &dyn Any),
            Child::Mode(_) | Child::Absent => None,
        };
        out.extend(any.and_then(|a| a.downcast_ref::<T>()));
        return;
    };
    if let Child::Module { module, .. } = node {
        let mut first = true;
        let any = wildcards && *segment == "*";
        module.visit_children(&mut |name, child| {
            if any || (first && name.matches(segment)) {
                first = any;
                walk(child, rest, wildcards, out);
            }
        });
    }
}

/// A typed path: from a root module `Root` to a `Target`, with a [`PathKind`]. Implemented by
/// [`Path`] and by the path types `#[module(paths)]` generates.
pub trait TypedPath: Clone + fmt::Display {
    /// The module the path starts at.
    type Root: 'static;
    /// What the path leads to.
    type Target: 'static;
    /// What is known about its existence.
    type Kind: PathKind;
    /// The path as a string: the state-dict path (or, after `each()`, a [`PathPattern`](crate::PathPattern)).
    fn as_str(&self) -> &str;
}

/// How a path type is made from its string (used by generated code).
pub trait FromPathString {
    #[doc(hidden)]
    fn __from_path_string(path: String) -> Self;
}

/// Types with typed paths: the derive with `#[module(paths)]`, the runtime's layers and
/// containers, and (as dead ends, with no path methods) configuration values.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no typed paths",
    label = "no typed paths",
    note = "add `#[module(paths)]` next to `#[derive(Module)]` on `{Self}`, or `#[module(skip)]` \
            the field, or drop `#[module(paths)]` from the type that holds it"
)]
pub trait HasPath: 'static {
    /// The path type of a path from `R` to `Self`, of kind `K`.
    type Path<R: 'static, K: PathKind>: FromPathString;
}

/// A typed path to a `T` inside an `R`, of kind `K`; the path type of the runtime's layers and
/// containers, and what a generated path type dereferences to. It dereferences to `str`.
pub struct Path<R, K, T: ?Sized> {
    path: String,
    _marker: PhantomData<Marker<R, K, T>>,
}

/// Covariant, and `Send + Sync` whatever the parameters.
type Marker<R, K, T> = fn() -> (*const R, *const K, *const T);

impl<R, K, T: ?Sized> Path<R, K, T> {
    /// The path as a string.
    pub fn as_str(&self) -> &str {
        &self.path
    }

    /// The path as a `String`.
    pub fn into_string(self) -> String {
        self.path
    }

    fn child<K2, T2: HasPath>(&self, segment: fmt::Arguments<'_>) -> T2::Path<R, K2>
    where
        R: 'static,
        K2: PathKind,
    {
        T2::Path::<R, K2>::__from_path_string(__child(&self.path, segment))
    }
}

#[doc(hidden)]
pub fn __child(parent: &str, segment: fmt::Arguments<'_>) -> String {
    use fmt::Write;
    let mut path = String::with_capacity(parent.len() + 8);
    path.push_str(parent);
    if !path.is_empty() {
        path.push('.');
    }
    let _ = path.write_fmt(segment);
    path
}

#[doc(hidden)]
pub fn __child_name(parent: &str, name: &str) -> String {
    let mut path = String::with_capacity(parent.len() + 1 + name.len());
    path.push_str(parent);
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(name);
    path
}

impl<R, K, T: ?Sized> FromPathString for Path<R, K, T> {
    fn __from_path_string(path: String) -> Self {
        Self {
            path,
            _marker: PhantomData,
        }
    }
}

impl<R, K, T: ?Sized> Clone for Path<R, K, T> {
    fn clone(&self) -> Self {
        Self::__from_path_string(self.path.clone())
    }
}

impl<R, K, T: ?Sized> std::ops::Deref for Path<R, K, T> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.path
    }
}

impl<R, K, T: ?Sized> AsRef<str> for Path<R, K, T> {
    fn as_ref(&self) -> &str {
        &self.path
    }
}

impl<R, K, T: ?Sized> fmt::Display for Path<R, K, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.path)
    }
}

impl<R, K, T: ?Sized> fmt::Debug for Path<R, K, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Path({:?})", self.path)
    }
}

impl<R, K, T: ?Sized> From<Path<R, K, T>> for String {
    fn from(p: Path<R, K, T>) -> String {
        p.path
    }
}

impl<R: 'static, K: PathKind, T: 'static> TypedPath for Path<R, K, T> {
    type Root = R;
    type Target = T;
    type Kind = K;
    fn as_str(&self) -> &str {
        &self.path
    }
}

/// The root of a typed path (`Self::path()` of a derived type is this, wrapped).
#[doc(hidden)]
pub fn __root<P: FromPathString>() -> P {
    P::__from_path_string(String::new())
}

/// `model.get(path)`: the module (or parameter, or buffer) a typed path leads to, as its own type.
pub trait PathExt: Module + Sized {
    /// `&T` for a [`Static`] path, `Option<&T>` for a [`Checked`] one (through an index, a key, an
    /// `Option`…), and `Vec<&T>` (every match) for an [`Each`] pattern.
    fn get<P>(&self, path: P) -> <P::Kind as Resolve>::Output<'_, P::Target>
    where
        P: TypedPath<Root = Self>,
        P::Kind: Resolve,
    {
        <P::Kind as Resolve>::__resolve::<P::Target>(self, path.as_str())
    }

    /// [`get`](PathExt::get), mutably: `&mut T` for a [`Static`] path, `Option<&mut T>` for a
    /// [`Checked`] one, and `Vec<&mut T>` for an [`Each`] pattern (every match once: the matches
    /// are disjoint, so all of them can be held at once). A path through an `Arc`
    /// ([`Shared`]) has none and does not compile: a shared module has no `&mut`.
    fn get_mut<P>(&mut self, path: P) -> <P::Kind as ResolveMut>::OutputMut<'_, P::Target>
    where
        P: TypedPath<Root = Self>,
        P::Kind: ResolveMut,
    {
        <P::Kind as ResolveMut>::__resolve_mut::<P::Target>(self, path.as_str())
    }
}

impl<M: Module> PathExt for M {}

mod containers;

pub use containers::{ByIndex, ByKey, ByName, Container, Dynamic, NamedParams, NoPath};
