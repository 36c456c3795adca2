//! `Module` for the types a derived module may hold besides other modules: the leaves ([`Param`],
//! [`Buffer`], [`Mode`]), configuration values (no-op leaves), and std's wrappers and containers
//! (`Option`, `Box`, `Arc`, `Vec`, arrays, `BTreeMap<String, _>`, tuples).

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::Arc;

use super::{Child, ChildMut, Mode, Module, Name};
use crate::buffer::Buffer;
use crate::identity::{CallTarget, Shared};
use crate::param::Param;
use crate::type_name::generic_class_name;

/// The class name of `T`, a container of modules, with each module argument in `args` (their Rust
/// names, from [`arg`]) shown by its class name: `Vec<BatchNorm1d>`.
fn composed<T: ?Sized>(args: &[(&str, String)]) -> String {
    generic_class_name(std::any::type_name::<T>(), args)
}

/// A module type argument as [`composed`] takes it: its Rust name and its class name.
fn arg<M: Module>() -> (&'static str, String) {
    (std::any::type_name::<M>(), M::type_class_name())
}

macro_rules! leaf {
    ($ty:ty, $variant:ident) => {
        #[diagnostic::do_not_recommend]
        impl Module for $ty {
            fn visit_children<'a>(&'a self, _: &mut dyn FnMut(Name<'_>, Child<'a>)) {}
            fn visit_children_mut<'a>(&'a mut self, _: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {}
            fn as_child(&self) -> Child<'_> {
                Child::$variant(self)
            }
            fn as_child_mut(&mut self) -> ChildMut<'_> {
                ChildMut::$variant(self)
            }
        }
    };
}
// A parametrized tensor's stand-in (`parametrized.rs`) is no child: its originals are.
#[diagnostic::do_not_recommend]
impl Module for Param {
    fn visit_children<'a>(&'a self, _: &mut dyn FnMut(Name<'_>, Child<'a>)) {}
    fn visit_children_mut<'a>(&'a mut self, _: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {}
    fn as_child(&self) -> Child<'_> {
        if self.is_parametrized() {
            return Child::Absent;
        }
        Child::Param(self)
    }
    fn as_child_mut(&mut self) -> ChildMut<'_> {
        if self.is_parametrized() {
            return ChildMut::Absent;
        }
        ChildMut::Param(self)
    }
}
leaf!(Buffer, Buffer);
leaf!(Mode, Mode);

macro_rules! config {
    ($([$($g:tt)*] $ty:ty),* $(,)?) => {$(
        #[diagnostic::do_not_recommend]
        impl<$($g)*> Module for $ty {
            fn visit_children<'a>(&'a self, _: &mut dyn FnMut(Name<'_>, Child<'a>)) {}
            fn visit_children_mut<'a>(&'a mut self, _: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {}
            fn as_child(&self) -> Child<'_> {
                Child::Absent
            }
            fn as_child_mut(&mut self) -> ChildMut<'_> {
                ChildMut::Absent
            }
            fn is_config() -> bool {
                true
            }
        }
    )*};
}
macro_rules! plain_config {
    ($($ty:ty),* $(,)?) => {
        config!($([] $ty),*);
    };
}
/// Calls `$m!` with every plain value type a derived struct may hold as configuration (numbers,
/// strings, dtypes, devices, shapes): one list for the `Module` impls here and the path types in
/// `typed_path`.
macro_rules! for_config_types {
    ($m:ident) => {
        $m!(
            (),
            bool,
            char,
            u8,
            u16,
            u32,
            u64,
            u128,
            usize,
            i8,
            i16,
            i32,
            i64,
            i128,
            isize,
            f32,
            f64,
            String,
            &'static str,
            candle_core::DType,
            candle_core::Device,
            candle_core::Shape,
        );
    };
}
pub(crate) use for_config_types;

for_config_types!(plain_config);
config!([T: ?Sized + Send + Sync + 'static] PhantomData<T>);

/// `None` is absent; `Some(m)` is `m` at the same path (PyTorch's `self.head = None`).
#[diagnostic::do_not_recommend]
impl<M: Module> Module for Option<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        if let Some(m) = self {
            m.visit_children(f);
        }
    }
    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        if let Some(m) = self {
            m.visit_children_mut(f);
        }
    }
    fn type_name(&self) -> &'static str {
        match self {
            Some(m) => m.type_name(),
            None => std::any::type_name::<Self>(),
        }
    }
    fn class_name(&self) -> String {
        match self {
            Some(m) => m.class_name(),
            None => Self::type_class_name(),
        }
    }
    fn type_class_name() -> String {
        composed::<Self>(&[arg::<M>()])
    }
    fn extra_state(&self) -> Option<&dyn crate::ExtraState> {
        self.as_ref().and_then(M::extra_state)
    }
    fn __repr_class(&self) -> Option<String> {
        self.as_ref().and_then(M::__repr_class)
    }
    fn __flattened<'a>(&'a self, f: &mut dyn FnMut(&'static str, &'a dyn Module)) {
        if let Some(m) = self {
            m.__flattened(f);
        }
    }
    fn as_child(&self) -> Child<'_> {
        self.as_ref().map_or(Child::Absent, M::as_child)
    }
    fn as_child_mut(&mut self) -> ChildMut<'_> {
        self.as_mut().map_or(ChildMut::Absent, M::as_child_mut)
    }
    fn is_config() -> bool {
        M::is_config()
    }
}

/// The methods a smart pointer to a module (`Box<M>`, `Arc<M>`) answers for the module inside.
macro_rules! pointee_methods {
    () => {
        fn type_name(&self) -> &'static str {
            (**self).type_name()
        }
        fn class_name(&self) -> String {
            (**self).class_name()
        }
        fn type_class_name() -> String {
            composed::<Self>(&[arg::<M>()])
        }
        fn extra_repr(&self) -> String {
            (**self).extra_repr()
        }
        fn __repr_collapses_repeats(&self) -> bool {
            (**self).__repr_collapses_repeats()
        }
        fn __repr_child(&self, child: &str) -> crate::ChildRepr {
            (**self).__repr_child(child)
        }
        fn __repr_class(&self) -> Option<String> {
            (**self).__repr_class()
        }
        fn is_config() -> bool {
            M::is_config()
        }
        fn extra_state(&self) -> Option<&dyn crate::ExtraState> {
            (**self).extra_state()
        }
        fn __flattened<'a>(&'a self, f: &mut dyn FnMut(&'static str, &'a dyn Module)) {
            (**self).__flattened(f);
        }
    };
}

/// Transparent: a boxed module is the module.
#[diagnostic::do_not_recommend]
impl<M: Module> Module for Box<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        (**self).visit_children(f);
    }
    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        (**self).visit_children_mut(f);
    }
    pointee_methods!();
    fn as_child(&self) -> Child<'_> {
        (**self).as_child()
    }
    fn as_child_mut(&mut self) -> ChildMut<'_> {
        (**self).as_child_mut()
    }
    fn __call_target(&self) -> CallTarget {
        (**self).__call_target()
    }
}

/// Shared ownership is identity: every `Arc` clone of one module is that one module, listed once,
/// under the first path it is reached by (PyTorch's dedup by object identity).
#[diagnostic::do_not_recommend]
impl<M: Module> Module for Arc<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        (**self).visit_children(f);
    }
    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        if let Some(m) = Arc::get_mut(self) {
            m.visit_children_mut(f);
        }
    }
    pointee_methods!();
    fn as_child(&self) -> Child<'_> {
        match (**self).as_child() {
            Child::Module { module, .. } => Child::Module {
                module,
                shared: Some(Shared::of(self)),
            },
            other => other,
        }
    }
    fn as_child_mut(&mut self) -> ChildMut<'_> {
        if Arc::get_mut(self).is_some() {
            Arc::get_mut(self).map_or(ChildMut::Absent, M::as_child_mut)
        } else {
            match (**self).as_child() {
                Child::Module { module, .. } => ChildMut::Shared(module),
                _ => ChildMut::Absent,
            }
        }
    }
}

/// A container is a module node, unless all it can hold is configuration (then it is absent).
fn container_child<L: Module>(container: &L) -> Child<'_> {
    if L::is_config() {
        Child::Absent
    } else {
        Child::Module {
            module: container,
            shared: None,
        }
    }
}

fn container_child_mut<L: Module>(container: &mut L) -> ChildMut<'_> {
    if L::is_config() {
        ChildMut::Absent
    } else {
        ChildMut::Module(container)
    }
}

/// `as_child`, `as_child_mut` and `is_config` of a container whose elements are `M`s: a module
/// node, or absent when `M` is configuration.
macro_rules! container_of_m {
    () => {
        fn as_child(&self) -> Child<'_> {
            container_child(self)
        }
        fn as_child_mut(&mut self) -> ChildMut<'_> {
            container_child_mut(self)
        }
        fn is_config() -> bool {
            M::is_config()
        }
        fn class_name(&self) -> String {
            Self::type_class_name()
        }
        fn type_class_name() -> String {
            composed::<Self>(&[arg::<M>()])
        }
    };
}

/// A list of modules: `Vec` (like PyTorch's `ModuleList`) and fixed-size arrays. Listed as a
/// module, elements named `0`, `1`, …; `print(model)` shows it as PyTorch's `ModuleList` (runs of
/// equal elements collapsed: `(0-5): 6 x Block(...)`).
macro_rules! list {
    ($([$($g:tt)*] $ty:ty),* $(,)?) => {$(
        #[diagnostic::do_not_recommend]
        impl<$($g)*> Module for $ty {
            fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
                for (i, m) in self.iter().enumerate() {
                    f(Name::Index(i), m.as_child());
                }
            }
            fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
                for (i, m) in self.iter_mut().enumerate() {
                    f(Name::Index(i), m.as_child_mut());
                }
            }
            fn __repr_collapses_repeats(&self) -> bool {
                true
            }
            fn __repr_class(&self) -> Option<String> {
                Some("ModuleList".to_owned())
            }
            container_of_m!();
        }
    )*};
}
list!([M: Module] Vec<M>, [M: Module, const N: usize] [M; N]);

/// A dictionary of modules, like PyTorch's `ModuleDict`, in key order: children are named by key;
/// `print(model)` shows it as `ModuleDict`.
#[diagnostic::do_not_recommend]
impl<M: Module> Module for BTreeMap<String, M> {
    fn __repr_class(&self) -> Option<String> {
        Some("ModuleDict".to_owned())
    }
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (k, m) in self {
            f(Name::Field(k), m.as_child());
        }
    }
    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for (k, m) in self.iter_mut() {
            f(Name::Field(k), m.as_child_mut());
        }
    }
    container_of_m!();
}

macro_rules! tuple {
    ($($t:ident $i:tt),+) => {
        /// A tuple of modules is a list: elements named `0`, `1`, ….
        #[diagnostic::do_not_recommend]
        impl<$($t: Module),+> Module for ($($t,)+) {
            fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
                $(f(Name::Index($i), self.$i.as_child());)+
            }
            fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
                $(f(Name::Index($i), self.$i.as_child_mut());)+
            }
            fn as_child(&self) -> Child<'_> {
                container_child(self)
            }
            fn as_child_mut(&mut self) -> ChildMut<'_> {
                container_child_mut(self)
            }
            fn is_config() -> bool {
                true $(&& $t::is_config())+
            }
            fn class_name(&self) -> String {
                Self::type_class_name()
            }
            fn type_class_name() -> String {
                composed::<Self>(&[$(arg::<$t>()),+])
            }
        }
    };
}
tuple!(A 0);
tuple!(A 0, B 1);
tuple!(A 0, B 1, C 2);
tuple!(A 0, B 1, C 2, D 3);
tuple!(A 0, B 1, C 2, D 3, E 4);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
