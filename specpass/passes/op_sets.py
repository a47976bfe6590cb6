"""Op sets the passes share: which ATen ops keep their input's values or only view it. A leaf: the
rule engine (row_rules/) and every pass read these without importing each other."""

import torch

aten = torch.ops.aten

# Ops whose output holds their first input's values (up to a dtype cast); the arg-max pass
# looks through them too.
SAME_VALUES = {
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default,
    aten.type_as.default, aten.detach.default, aten.clone.default, aten.alias.default, aten.contiguous.default,
    aten.lift_fresh_copy.default,
}
# A view of the first operand with a new shape (view_as / reshape_as: another tensor's, read for
# its shape only).
RESHAPES = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.view_as.default, aten.reshape_as.default,
}
VIEWS = RESHAPES | {aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
                    aten.select.int, aten.slice.Tensor, aten.alias.default, aten.detach.default}
EXPANDS = {aten.expand.default, aten.expand_as.default}  # expand_as reads its second operand for its shape only
