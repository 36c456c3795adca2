#[automatically_derived]
impl<T> ::module_runtime::TensorStruct for Encoded<T>
where
    T: 'static,
    Option<T>: ::module_runtime::TensorTree,
{
    fn for_each_tensor(
        &self,
        __f: &mut dyn ::core::ops::FnMut(&::module_runtime::candle_core::Tensor),
    ) {
        <Tensor as ::module_runtime::TensorTree>::for_each_tensor(&self.hidden, __f);
        <Option<T> as ::module_runtime::TensorTree>::for_each_tensor(&self.pooled, __f);
    }
    fn map_tensors(
        self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::candle_core::Tensor,
        ) -> ::module_runtime::candle_core::Tensor,
    ) -> Self {
        let Self { hidden: __field0, pooled: __field1, lengths: __field2 } = self;
        Self {
            hidden: ::module_runtime::__private::map_tree::<Tensor>(__field0, __f),
            pooled: ::module_runtime::__private::map_tree::<Option<T>>(__field1, __f),
            lengths: __field2,
        }
    }
    fn clone_tree(&self) -> ::core::option::Option<Self> {
        #[allow(unused_imports)]
        use ::module_runtime::__private::{ViaClone as _, ViaNone as _};
        (&::module_runtime::__private::CloneProbe(self)).clone_tree()
    }
}
