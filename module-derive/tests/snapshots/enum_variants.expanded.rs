#[automatically_derived]
#[diagnostic::do_not_recommend]
impl ::module_runtime::Module for Head {
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        match self {
            Self::Linear(__field0) => {
                <Linear as ::module_runtime::Module>::visit_children(__field0, __f)
            }
            Self::Pair(__field0, _) => {
                __f(
                    ::module_runtime::Name::Index(0usize),
                    <Linear as ::module_runtime::Module>::as_child(__field0),
                );
            }
            Self::Scaled { proj: __field0, scale: __field1 } => {
                __f(
                    ::module_runtime::Name::Field("proj"),
                    <Linear as ::module_runtime::Module>::as_child(__field0),
                );
                __f(
                    ::module_runtime::Name::Field("gamma"),
                    <Param as ::module_runtime::Module>::as_child(__field1),
                );
            }
            Self::Identity => {}
        }
    }
    fn visit_children_mut<'__module>(
        &'__module mut self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::ChildMut<'__module>,
        ),
    ) {
        match self {
            Self::Linear(__field0) => {
                <Linear as ::module_runtime::Module>::visit_children_mut(__field0, __f)
            }
            Self::Pair(__field0, _) => {
                __f(
                    ::module_runtime::Name::Index(0usize),
                    <Linear as ::module_runtime::Module>::as_child_mut(__field0),
                );
            }
            Self::Scaled { proj: __field0, scale: __field1 } => {
                __f(
                    ::module_runtime::Name::Field("proj"),
                    <Linear as ::module_runtime::Module>::as_child_mut(__field0),
                );
                __f(
                    ::module_runtime::Name::Field("gamma"),
                    <Param as ::module_runtime::Module>::as_child_mut(__field1),
                );
            }
            Self::Identity => {}
        }
    }
    fn as_child(&self) -> ::module_runtime::Child<'_> {
        #[allow(unreachable_patterns)]
        match self {
            Self::Linear(__field0) => {
                <Linear as ::module_runtime::Module>::as_child(__field0)
            }
            _ => {
                ::module_runtime::Child::Module {
                    module: self,
                    shared: ::core::option::Option::None,
                }
            }
        }
    }
    fn as_child_mut(&mut self) -> ::module_runtime::ChildMut<'_> {
        #[allow(unreachable_patterns)]
        match self {
            Self::Linear(__field0) => {
                <Linear as ::module_runtime::Module>::as_child_mut(__field0)
            }
            _ => ::module_runtime::ChildMut::Module(self),
        }
    }
}
#[automatically_derived]
impl ::core::fmt::Display for Head {
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
