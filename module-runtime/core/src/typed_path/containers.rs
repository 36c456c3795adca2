//! The path types of the runtime's own types: configuration values (no path), leaves, `Option`,
//! `Box`, `Arc`, and the containers (lists, arrays, maps, tuples) with the traits that give a
//! path its `each`, `at`, `key`, `named`, `of` and `param` segments.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::Arc;

use super::{Each, FromPathString, HasPath, Indexed, Path, PathKind, Shared};
use crate::{Buffer, Param};

/// A dead end: the path type of configuration values, which are not in the module tree.
#[derive(Clone, Copy, Debug)]
pub struct NoPath;

impl FromPathString for NoPath {
    fn __from_path_string(_: String) -> Self {
        NoPath
    }
}

macro_rules! no_path {
    ($($ty:ty),* $(,)?) => {$(
        impl HasPath for $ty {
            type Path<R: 'static, K: PathKind> = NoPath;
        }
    )*};
}
crate::module::for_config_types!(no_path);
no_path!(crate::Mode);

impl<T: ?Sized + 'static> HasPath for PhantomData<T> {
    type Path<R: 'static, K: PathKind> = NoPath;
}

macro_rules! node_path {
    ($($ty:ty),* $(,)?) => {$(
        impl HasPath for $ty {
            type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
        }
    )*};
}
node_path!(Param, Buffer);

impl<M: HasPath> HasPath for Option<M> {
    type Path<R: 'static, K: PathKind> = M::Path<R, K::Checked>;
}
impl<M: HasPath> HasPath for Box<M> {
    type Path<R: 'static, K: PathKind> = M::Path<R, K>;
}
impl<M: HasPath> HasPath for Arc<M> {
    type Path<R: 'static, K: PathKind> = M::Path<R, Shared<K>>;
}

/// A module whose children are all of one type, [`Item`](Container::Item): lists, maps,
/// `Sequential`. Its path has [`each`](Path::each), the pattern segment `*`, and by how the
/// children are found, `at` ([`ByIndex`]), `key` ([`ByKey`]) or `named` ([`ByName`]).
pub trait Container: HasPath {
    /// The children's type.
    type Item: HasPath;
}

/// A [`Container`] whose children are found by position: its path has [`at`](Path::at).
pub trait ByIndex: Container {}

/// A [`Container`] whose children are found by key: its path has [`key`](Path::key).
pub trait ByKey: Container {}

/// A [`Container`] whose children may have names (`Sequential::push_named`): its path has
/// [`named`](Path::named).
pub trait ByName: Container {}

/// A module whose type is known only at run time (a `Sequential` layer): its path has
/// [`of`](Path::of), which names the type.
pub trait Dynamic: HasPath {}

/// A module whose parameters are named only at run time (`Native`): its path has
/// [`param`](Path::param).
pub trait NamedParams: HasPath {}

impl<R: 'static, K: PathKind, T: Container> Path<R, K, T> {
    /// Every child: the pattern segment `*`.
    pub fn each(&self) -> <T::Item as HasPath>::Path<R, Each> {
        self.child::<_, T::Item>(format_args!("*"))
    }
}

impl<R: 'static, K: PathKind, T: ByIndex> Path<R, K, T> {
    /// Child `index` (checked at run time by [`get`](super::PathExt::get)).
    pub fn at(&self, index: usize) -> <T::Item as HasPath>::Path<R, Indexed<K>> {
        self.child::<_, T::Item>(format_args!("{index}"))
    }
}

impl<R: 'static, K: PathKind, T: ByKey> Path<R, K, T> {
    /// The entry `key` (checked at run time by [`get`](super::PathExt::get)). A key is one path
    /// segment: maps refuse a key that is empty or holds `.` or `*` where it enters
    /// ([`Error::InvalidKey`](crate::Error::InvalidKey)), so no entry has such a key: a
    /// `*` in it is no wildcard here, and a `.` reads as two segments.
    pub fn key(&self, key: &str) -> <T::Item as HasPath>::Path<R, Indexed<K>> {
        self.child::<_, T::Item>(format_args!("{key}"))
    }
}

impl<R: 'static, K: PathKind, T: ByName> Path<R, K, T> {
    /// The child called `name` (a layer added by `push_named`).
    pub fn named(&self, name: &str) -> <T::Item as HasPath>::Path<R, Indexed<K>> {
        self.child::<_, T::Item>(format_args!("{name}"))
    }
}

impl<R: 'static, K: PathKind, T: Dynamic> Path<R, K, T> {
    /// The module as a `U`: checked at run time by [`get`](super::PathExt::get) (and by a typed
    /// hook).
    pub fn of<U: HasPath>(&self) -> U::Path<R, K::Checked> {
        U::Path::<R, K::Checked>::__from_path_string(self.path.clone())
    }
}

impl<R: 'static, K: PathKind, T: NamedParams> Path<R, K, T> {
    /// The parameter called `name` (`weight`, `bias`, …).
    pub fn param(&self, name: &str) -> Path<R, Indexed<K>, Param> {
        self.child::<_, Param>(format_args!("{name}"))
    }
}

macro_rules! list_path {
    ($([$($g:tt)*] $ty:ty),* $(,)?) => {$(
        impl<$($g)*> HasPath for $ty {
            type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
        }
        impl<$($g)*> Container for $ty {
            type Item = M;
        }
    )*};
}
list_path!(
    [M: HasPath] Vec<M>,
    [M: HasPath, const N: usize] [M; N],
    [M: HasPath] BTreeMap<String, M>,
);
impl<M: HasPath> ByIndex for Vec<M> {}
impl<M: HasPath, const N: usize> ByIndex for [M; N] {}
impl<M: HasPath> ByKey for BTreeMap<String, M> {}

macro_rules! tuple_path {
    ($($t:ident $i:tt $m:ident),+) => {
        impl<$($t: HasPath),+> HasPath for ($($t,)+) {
            type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
        }

        impl<R: 'static, K: PathKind, $($t: HasPath),+> Path<R, K, ($($t,)+)> {
            $(
                #[doc = concat!("Element `", stringify!($i), "`.")]
                pub fn $m(&self) -> $t::Path<R, K::Field> {
                    self.child::<_, $t>(format_args!("{}", $i))
                }
            )+
        }
    };
}
tuple_path!(A 0 _0);
tuple_path!(A 0 _0, B 1 _1);
tuple_path!(A 0 _0, B 1 _1, C 2 _2);
tuple_path!(A 0 _0, B 1 _1, C 2 _2, D 3 _3);
