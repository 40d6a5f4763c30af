"""The layout language: parsing, PartitionSpecs, meshes and every error a user can cause."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtrain.parallel.layout import Layout, LayoutError, constrain, parse_layout_rules, parse_mesh_shape


@pytest.mark.parametrize(
    "text", ["batch:16;model:32", "batch:16,model:32", "batch:16.model:32", "batch:16 model:32",
             " batch:16 ;  model:32 "]
)
def test_mesh_shape_separators(text):
    assert parse_mesh_shape(text) == [("batch", 16), ("model", 32)]


def test_layout_rules_separators():
    expected = [("batch", "batch"), ("d_ff", "model")]
    for text in ["batch:batch;d_ff:model", "batch:batch,d_ff:model", "batch:batch.d_ff:model",
                 "batch:batch d_ff:model"]:
        assert parse_layout_rules(text) == expected


def test_empty_mesh_is_one_device():
    layout = Layout("", "")
    assert parse_mesh_shape("") == [] and layout.size == 1
    assert layout.partition_spec(("batch", "length", "d_model")) == P(None, None, None)
    mesh = layout.make_mesh(jax.devices()[:1])
    assert mesh.devices.size == 1


def test_mesh_tf_example():
    # Mesh-TF's own case: a batch:4 x model:8 mesh with batch and d_ff split.
    layout = Layout("batch:4;model:8", "batch:batch;d_ff:model")
    assert layout.size == 32
    assert layout.partition_spec(("batch", "length", "d_model")) == P("batch", None, None)
    assert layout.partition_spec(("d_model", "d_ff")) == P(None, "model")
    assert layout.partition_spec(("d_ff", "d_model"), (64, 16)) == P("model", None)


def test_parsed_lists_are_accepted():
    layout = Layout([("batch", 2), ("model", 4)], [("batch", "batch"), ("heads", "model")])
    assert layout.partition_spec(("batch", "heads")) == P("batch", "model")


@pytest.mark.parametrize(
    "mesh, rules, message",
    [
        ("d_ff;heads", "", "malformed mesh shape 'd_ff;heads': 'd_ff' is not a 'name:value' pair"),
        ("batch:x", "", "size of mesh dimension 'batch' must be a positive integer, got 'x'"),
        ("batch:0", "", "size of mesh dimension 'batch' must be a positive integer, got '0'"),
        ("batch:2;batch:4", "", "names 'batch' twice"),
        ("batch:2", "d_ff;heads", "malformed layout rules 'd_ff;heads'"),
        ("batch:2", "batch:batch;batch:batch", "names 'batch' twice"),
        ("batch:2", "d_ff:model", "names mesh dimension 'model', but the mesh 'batch:2' has no"),
        ("batch:2", "a:b:c", "'a:b:c' is not a 'name:value' pair"),
    ],
)
def test_malformed_strings(mesh, rules, message):
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        Layout(mesh, rules)


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_two_dimensions_on_one_mesh_dimension():
    layout = Layout("model:8", "d_model:model;d_ff:model")
    with pytest.raises(LayoutError) as e:
        layout.partition_spec(("d_model", "d_ff"), tensor="mlp/wi")
    msg = str(e.value)
    assert "mlp/wi" in msg and "'d_model' and 'd_ff'" in msg and "mesh dimension 'model'" in msg


def test_not_divisible_names_everything():
    layout = Layout("batch:2;model:4", "d_ff:model")
    with pytest.raises(LayoutError) as e:
        layout.partition_spec(("d_model", "d_ff"), (16, 6), tensor="layer_0/mlp/wi")
    msg = str(e.value)
    for part in ["layer_0/mlp/wi", "'d_ff'", "size 6", "mesh dimension 'model'", "size 4"]:
        assert part in msg


def test_rank_mismatch():
    with pytest.raises(LayoutError, match="2 dimension names"):
        Layout("", "").partition_spec(("a", "b"), (1, 2, 3))


def test_mesh_size_must_match_devices():
    layout = Layout("batch:4;model:4", "")
    with pytest.raises(LayoutError) as e:
        layout.make_mesh()
    assert "needs 16 devices" in str(e.value) and "8 are available" in str(e.value)


def test_make_mesh_over_all_devices():
    mesh = Layout("batch:4;model:2", "batch:batch").make_mesh()
    assert dict(mesh.shape) == {"batch": 4, "model": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_data_major_mesh_keeps_consecutive_devices_on_a_batch_block():
    # As with two hosts of 4 devices (0-3 and 4-7): laid out data-major, the first host's
    # devices hold batch positions 0 and 1 of a model:2;batch:4 mesh, whatever the order of
    # the mesh dimensions, so each host feeds half the batch.
    for mesh_shape in ["model:2;batch:4", "batch:4;model:2"]:
        mesh = Layout(mesh_shape, "batch:batch;d_ff:model").make_mesh(data_major=True)
        assert dict(mesh.shape) == {"model": 2, "batch": 4}
        batch_axis = mesh.axis_names.index("batch")
        first_host = {int(np.argwhere(mesh.devices == d)[0][batch_axis])
                      for d in mesh.devices.flat if d.id < 4}
        assert first_host == {0, 1}, mesh_shape
    plain = Layout("model:2;batch:4", "batch:batch").make_mesh(data_major=False)
    assert [d.id for d in plain.devices[0]] == [0, 1, 2, 3]  # model-major: each host all rows


def test_constrain_is_a_no_op_without_layout_and_shards_with_one():
    layout = Layout("batch:2;model:4", "batch:batch;d_ff:model")
    mesh = layout.make_mesh()
    x = jnp.ones((4, 3, 8))
    assert constrain(x, ("batch", "length", "d_ff")) is x

    @jax.jit
    def f(x):
        with layout.activate(mesh):
            return constrain(x * 2, ("batch", "length", "d_ff"))

    y = f(x)
    assert y.sharding.spec == P("batch", None, "model")
    np.testing.assert_array_equal(y, 2 * np.ones((4, 3, 8)))
    assert {s.data.shape for s in y.addressable_shards} == {(2, 3, 2)}


def test_rules_for_absent_mesh_dimensions_can_be_dropped():
    # The run uses Mesh-TF's behaviour so one set of rules serves every mesh.
    layout = Layout("batch:8", "batch:batch;d_ff:model", drop_unused_rules=True)
    assert layout.dropped_rules == [("d_ff", "model")]
    assert layout.partition_spec(("batch", "d_ff")) == P("batch", None)


# --- parameter layout rules (fully sharded data parallelism) -----------------------------

def test_parameter_rules_lay_out_parameters_on_top_of_the_layout_rules():
    layout = Layout("batch:4;model:2", "batch:batch;d_ff:model", "d_model:batch")
    assert layout.partition_spec(("d_model", "d_ff"), parameter=True) == P("batch", "model")
    # Activations follow the layout rules alone: d_model stays whole beside batch.
    assert layout.partition_spec(("batch", "length", "d_model")) == P("batch", None, None)
    assert layout.partition_spec(("d_model", "d_ff")) == P(None, "model")
    assert layout.parameter_rules_text == "d_model:batch"
    # A parameter rule takes the place of the layout rule for the same dimension.
    override = Layout("batch:4;model:2", "d_ff:model", "d_ff:batch")
    assert override.partition_spec(("d_model", "d_ff"), parameter=True) == P(None, "batch")


@pytest.mark.parametrize("rules, message", [
    ("d_model", "malformed parameter layout rules 'd_model'"),
    ("d_model:data", "parameter layout rule 'd_model:data' names mesh dimension 'data', but "
                     "the mesh 'batch:4;model:2' has no such dimension"),
    ("d_model:batch;d_model:model", "parameter layout rules 'd_model:batch;d_model:model' "
                                    "names 'd_model' twice"),
])
def test_malformed_parameter_rules_name_their_rule_set(rules, message):
    with pytest.raises(LayoutError, match=message):
        Layout("batch:4;model:2", "batch:batch", rules)


def test_parameter_layout_errors_name_the_rules_that_collide():
    layout = Layout("batch:4;model:2", "d_ff:model", "d_model:model")
    with pytest.raises(LayoutError) as e:
        layout.partition_spec(("d_model", "d_ff"), tensor="mlp/wi", parameter=True)
    assert ("parameter rule 'd_model:model' or the layout rule 'd_ff:model'" in str(e.value)
            and "mlp/wi" in str(e.value))
    with pytest.raises(LayoutError, match="of size 6 is not divisible by mesh dimension 'batch' "
                                          "of size 4 .* or the parameter rule 'd_model:batch'"):
        Layout("batch:4", "", "d_model:batch").partition_spec(("d_model",), (6,), parameter=True)
    # Unknown tensor dimensions: a parameter rule must name a parameter's dimension.
    typo = Layout("batch:4", "batch:batch", "dmodel:batch")
    typo.partition_spec(("d_model", "d_ff"), parameter=True)
    typo.partition_spec(("batch", "length", "d_model"))
    with pytest.raises(LayoutError, match="parameter layout rule 'dmodel:batch' names tensor "
                                          "dimension 'dmodel', which no parameter"):
        typo.check_rules_used()
    activation_only = Layout("batch:4", "batch:batch", "length:batch")
    activation_only.partition_spec(("batch", "length"))
    with pytest.raises(LayoutError, match="which no parameter of the model has"):
        activation_only.check_rules_used()


def test_parameter_rules_for_absent_mesh_dimensions_can_be_dropped():
    layout = Layout("", "batch:batch", "d_model:batch", drop_unused_rules=True)
    assert layout.dropped_parameter_rules == [("d_model", "batch")]
    assert layout.partition_spec(("d_model",), parameter=True) == P(None)
