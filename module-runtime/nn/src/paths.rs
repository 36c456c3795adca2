//! Typed paths through the runtime's containers ([`typed_path`](crate::typed_path)):
//! `Sequential` and `ModuleList` are indexed with `at(i)` (and `Sequential`'s named layers with
//! `named(name)`), `ModuleDict` with `key(k)`, a `Sequential` layer names its type with
//! `of::<T>()`, a `Native` layer its parameters with `param(name)`, and `Lazy` adds no segment
//! (it makes the path `Checked`, as `Option` does).

use crate::typed_path::{
    ByIndex, ByKey, ByName, Container, Dynamic, HasPath, NamedParams, Path, PathKind,
};
use crate::Lazy;

use super::{ModuleDict, ModuleList, Native, NativeLayer, Sequential, SequentialLayer};

impl HasPath for Sequential {
    type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
}
impl Container for Sequential {
    type Item = Box<dyn SequentialLayer>;
}
impl ByIndex for Sequential {}
impl ByName for Sequential {}

impl HasPath for Box<dyn SequentialLayer> {
    type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
}
impl Dynamic for Box<dyn SequentialLayer> {}

impl<M: HasPath> HasPath for ModuleList<M> {
    type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
}
impl<M: HasPath> Container for ModuleList<M> {
    type Item = M;
}
impl<M: HasPath> ByIndex for ModuleList<M> {}

impl<M: HasPath> HasPath for ModuleDict<M> {
    type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
}
impl<M: HasPath> Container for ModuleDict<M> {
    type Item = M;
}
impl<M: HasPath> ByKey for ModuleDict<M> {}

impl<L: NativeLayer> HasPath for Native<L> {
    type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
}
impl<L: NativeLayer> NamedParams for Native<L> {}

impl<M: HasPath> HasPath for Lazy<M> {
    type Path<R: 'static, K: PathKind> = M::Path<R, K::Checked>;
}
