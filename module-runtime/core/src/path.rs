//! Path lookup: the submodule, parameter or buffer at a dotted path (`get_submodule`,
//! `get_parameter`, `get_buffer`), one segment at a time through one child search.

use crate::error::{Error, Result};
use crate::module::{Child, ChildMut, Module, Name};

/// Whether `key` can be one segment of a path: non-empty, no `.` (PyTorch's `add_module` rule)
/// and no `*` (a pattern's wildcard).
pub fn is_segment(key: &str) -> bool {
    !key.is_empty() && !key.contains(['.', '*'])
}

/// [`Error::InvalidKey`] unless `key` [is a segment](is_segment).
pub fn check_key(container: &'static str, path: &str, key: &str) -> Result<()> {
    if is_segment(key) {
        return Ok(());
    }
    Err(Error::InvalidKey {
        container,
        path: path.to_owned(),
        key: key.to_owned(),
    })
}

/// Every name in the tree is a path segment, and no module has two children of one name: the
/// keys of a `BTreeMap<String, _>` enter through `std`, and the children of a
/// `#[module(flatten)]`ed field share its parent's names, which the derive cannot see, so both
/// are checked here, by what turns them into paths (the state dict and loads). Struct fields
/// (checked by the derive) and the runtime's containers (checked on insert) pass.
pub fn check_keys(root: &dyn Module) -> Result<()> {
    fn visit(module: &dyn Module, path: &mut String) -> Result<()> {
        check_flattened(module, path)?;
        let mut result = Ok(());
        module.visit_children(&mut |name, child| {
            if result.is_err() {
                return;
            }
            if let Name::Field(key) = &name
                && !is_segment(key)
            {
                result = check_key("BTreeMap", path, key);
                return;
            }
            if let Child::Module { module, .. } = child {
                let len = path.len();
                name.push_to(path);
                result = visit(module, path);
                path.truncate(len);
            }
        });
        result
    }
    visit(root, &mut String::new())
}

/// [`Error::DuplicateName`] if two of `module`'s children (parameters, buffers, submodules) have
/// one name, or it has two extra states: only a module with `#[module(flatten)]`ed fields can
/// (the derive refuses two fields of one name; containers have distinct keys), so the others cost
/// one call. Absent children (`None`, configuration) and train/eval flags hold nothing a state
/// dict or a path lookup would lose, and are not counted.
fn check_flattened(module: &dyn Module, path: &str) -> Result<()> {
    let mut fields: Vec<&'static str> = Vec::new();
    module.__flattened(&mut |field, _| fields.push(field));
    if fields.is_empty() {
        return Ok(());
    }
    let duplicate = |name: &str, first: &'static str, second: &'static str, fields| {
        let mut full = path.to_owned();
        Name::Field(name).push_to(&mut full);
        Err(Error::DuplicateName {
            path: full,
            parent_type: module.class_name().into(),
            first,
            second,
            fields,
        })
    };
    let mut seen: std::collections::HashMap<String, &'static str> = Default::default();
    let mut clash = None;
    module.visit_children(&mut |name, child| {
        let kind = match child {
            Child::Module { .. } => "module",
            Child::Param(_) => "parameter",
            Child::Buffer(_) => "buffer",
            Child::Mode(_) | Child::Absent => return,
        };
        if clash.is_some() {
            return;
        }
        let name = name.to_string();
        match seen.get(&name) {
            Some(first) => clash = Some((name, *first, kind)),
            None => {
                seen.insert(name, kind);
            }
        }
    });
    if let Some((name, first, second)) = clash {
        return duplicate(&name, first, second, fields);
    }
    // Extra state: the module's own, and each flattened field's (its own or lifted in turn).
    let mut owners: Vec<&'static str> = Vec::new();
    module.__flattened(&mut |field, value| {
        if crate::walk::extra_state(value).is_some() {
            owners.push(field);
        }
    });
    let own = module.extra_state().is_some();
    if owners.len() + usize::from(own) > 1 {
        owners.truncate(if own { 1 } else { 2 });
        let key = crate::extra_state::EXTRA_STATE_KEY;
        return duplicate(key, "extra state", "extra state", owners);
    }
    Ok(())
}

/// The segments of a dotted path; the root's path `""` has none.
fn segments(path: &str) -> impl Iterator<Item = &str> {
    path.split('.').filter(|_| !path.is_empty())
}

/// What a child is, in words, for errors.
trait Kind {
    fn kind(&self) -> &'static str;
    fn is_absent(&self) -> bool {
        self.kind() == "nothing"
    }
}

impl Kind for Child<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Child::Module { .. } => "module",
            Child::Param(_) => "parameter",
            Child::Buffer(_) => "buffer",
            Child::Mode(_) => "train/eval flag",
            Child::Absent => "nothing",
        }
    }
}

impl Kind for ChildMut<'_> {
    fn kind(&self) -> &'static str {
        match self {
            ChildMut::Module(_) | ChildMut::Shared(_) => "module",
            ChildMut::Param(_) => "parameter",
            ChildMut::Buffer(_) => "buffer",
            ChildMut::Mode(_) => "train/eval flag",
            ChildMut::Absent => "nothing",
        }
    }
}

/// The child named `segment` among those `visit` lists, or the names of the children there are.
fn find_child<C: Kind>(
    visit: impl FnOnce(&mut dyn FnMut(Name<'_>, C)),
    segment: &str,
) -> std::result::Result<C, Vec<String>> {
    let mut found = None;
    let mut children = Vec::new();
    visit(&mut |name, child| {
        if child.is_absent() {
            return;
        }
        if found.is_none() && name.matches(segment) {
            found = Some(child);
        } else {
            children.push(name.to_string());
        }
    });
    found.ok_or(children)
}

/// The submodule at `path` (`""` is `root`).
pub fn submodule<'a>(root: &'a dyn Module, path: &str) -> Result<&'a dyn Module> {
    let mut current = root;
    let mut walked = String::new();
    for segment in segments(path) {
        match find_child(|f| current.visit_children(f), segment) {
            Ok(Child::Module { module, .. }) => current = module,
            Ok(other) => return Err(wrong_kind(path, "module", other.kind())),
            Err(children) => {
                return Err(no_child(path, walked, current, segment, children));
            }
        }
        Name::Field(segment).push_to(&mut walked);
    }
    Ok(current)
}

/// The submodule at `path`, mutably. A module shared through an `Arc` with other owners cannot be
/// borrowed mutably.
pub fn submodule_mut<'a>(root: &'a mut dyn Module, path: &str) -> Result<&'a mut dyn Module> {
    let mut current = root;
    let mut walked = String::new();
    for segment in segments(path) {
        let parent_type = current.class_name();
        match find_child(move |f| current.visit_children_mut(f), segment) {
            Ok(ChildMut::Module(module)) => current = module,
            Ok(ChildMut::Shared(_)) => {
                Name::Field(segment).push_to(&mut walked);
                return Err(Error::SharedModule { path: walked });
            }
            Ok(other) => return Err(wrong_kind(path, "module", other.kind())),
            Err(children) => {
                return Err(Error::NoSubmodule {
                    path: path.to_owned(),
                    parent: walked,
                    parent_type: parent_type.into(),
                    missing: segment.to_owned(),
                    children,
                });
            }
        }
        Name::Field(segment).push_to(&mut walked);
    }
    Ok(current)
}

/// The leaf (parameter or buffer) at `path`, checked to be the `expected` kind.
pub fn leaf<'a>(root: &'a dyn Module, path: &str, expected: &'static str) -> Result<Child<'a>> {
    let (parent_path, last) = path.rsplit_once('.').unwrap_or(("", path));
    let parent = submodule(root, parent_path)?;
    match find_child(|f| parent.visit_children(f), last) {
        Ok(child) if child.kind() == expected => Ok(child),
        Ok(other) => Err(wrong_kind(path, expected, other.kind())),
        Err(children) => Err(no_child(
            path,
            parent_path.to_owned(),
            parent,
            last,
            children,
        )),
    }
}

/// The module at `path` downcast to `T`, or the error naming the type that is there.
pub fn downcast<'a, T: Module>(path: &str, module: &'a dyn Module) -> Result<&'a T> {
    module
        .downcast_ref::<T>()
        .ok_or_else(|| wrong_type::<T>(path, module))
}

/// Like [`downcast`], mutably.
pub fn downcast_mut<'a, T: Module>(path: &str, module: &'a mut dyn Module) -> Result<&'a mut T> {
    if !module.is::<T>() {
        return Err(wrong_type::<T>(path, module));
    }
    Ok(module
        .downcast_mut::<T>()
        .expect("the type was checked above"))
}

fn no_child(
    path: &str,
    parent: String,
    parent_module: &dyn Module,
    missing: &str,
    children: Vec<String>,
) -> Error {
    Error::NoSubmodule {
        path: path.to_owned(),
        parent,
        parent_type: parent_module.class_name().into(),
        missing: missing.to_owned(),
        children,
    }
}

fn wrong_kind(path: &str, expected: &'static str, found: &'static str) -> Error {
    Error::WrongKind {
        path: path.to_owned(),
        expected,
        found,
    }
}

fn wrong_type<T: Module>(path: &str, found: &dyn Module) -> Error {
    Error::WrongModuleType {
        path: path.to_owned(),
        expected: T::type_class_name(),
        found: found.class_name(),
    }
}
