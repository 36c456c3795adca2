#[automatically_derived]
#[diagnostic::do_not_recommend]
impl mr::Module for Net {
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(mr::Name<'_>, mr::Child<'__module>),
    ) {
        __f(mr::Name::Field("fc"), <mr::nn::Linear as mr::Module>::as_child(&self.fc));
    }
    fn visit_children_mut<'__module>(
        &'__module mut self,
        __f: &mut dyn ::core::ops::FnMut(mr::Name<'_>, mr::ChildMut<'__module>),
    ) {
        __f(
            mr::Name::Field("fc"),
            <mr::nn::Linear as mr::Module>::as_child_mut(&mut self.fc),
        );
    }
}
#[automatically_derived]
impl ::core::fmt::Display for Net {
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&mr::module_repr(self))
    }
}
