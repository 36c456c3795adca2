#[automatically_derived]
#[diagnostic::do_not_recommend]
impl ::module_runtime::Module for Block {
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("LayerNorm"),
            <LayerNorm as ::module_runtime::Module>::as_child(&self.norm),
        );
        <Attention as ::module_runtime::Module>::visit_children(&self.attention, __f);
        __f(
            ::module_runtime::Name::Field("type"),
            <Linear as ::module_runtime::Module>::as_child(&self.r#type),
        );
    }
    fn visit_children_mut<'__module>(
        &'__module mut self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::ChildMut<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("LayerNorm"),
            <LayerNorm as ::module_runtime::Module>::as_child_mut(&mut self.norm),
        );
        <Attention as ::module_runtime::Module>::visit_children_mut(
            &mut self.attention,
            __f,
        );
        __f(
            ::module_runtime::Name::Field("type"),
            <Linear as ::module_runtime::Module>::as_child_mut(&mut self.r#type),
        );
    }
    fn __flattened<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            &'static str,
            &'__module dyn ::module_runtime::Module,
        ),
    ) {
        __f(
            "attention",
            <Attention as ::module_runtime::Module>::__as_dyn(&self.attention),
        );
    }
}
#[automatically_derived]
impl ::core::fmt::Display for Block {
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
