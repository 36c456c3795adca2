::core::compile_error! {
    "unknown `#[module(...)]` key `transparent` on a type: expected `crate`, `bound`, `extra_state`, `extra_repr`, `paths`, `no_display` or `class_name`"
}
::core::compile_error! {
    "a skipped field has no name to `rename`; remove `rename`, or `skip` if the field is a module"
}
::core::compile_error! {
    "`#[module(skip)]` on a `Param` would leave it out of training and checkpoints without a word; remove `skip` (to freeze it, call `freeze` on its path)"
}
#[automatically_derived]
#[diagnostic::do_not_recommend]
impl<T> mr::Module for Net<T>
where
    T: ::core::marker::Send + ::core::marker::Sync + 'static,
{
    fn visit_children<'__module>(
        &'__module self,
        _: &mut dyn ::core::ops::FnMut(mr::Name<'_>, mr::Child<'__module>),
    ) {}
    fn visit_children_mut<'__module>(
        &'__module mut self,
        _: &mut dyn ::core::ops::FnMut(mr::Name<'_>, mr::ChildMut<'__module>),
    ) {}
}
