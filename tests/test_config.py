import pytest

from credit_parallel import ParallelDims, load_config, parse_parallelism_conf


def conf(**block):
    return {"trainer": {"parallelism": block}}


def test_defaults_when_block_empty():
    assert parse_parallelism_conf(conf()) == {"data": "none", "tensor": 1, "domain": 1}


def test_string_digits_accepted_and_converted():
    assert parse_parallelism_conf(conf(data="fsdp2", tensor="2", domain="4")) == {
        "data": "fsdp2",
        "tensor": 2,
        "domain": 4,
    }


@pytest.mark.parametrize(
    "full, key, value",
    [
        ({}, "trainer", ""),
        ({"trainer": {}}, "trainer.parallelism", ""),
        (conf(data="fsdp2", pipeline=2), "pipeline", ""),
        (conf(data="zero3"), "trainer.parallelism.data", "zero3"),
        (conf(tensor=0), "trainer.parallelism.tensor", "0"),
        (conf(domain=-1), "trainer.parallelism.domain", "-1"),
        (conf(tensor=True), "trainer.parallelism.tensor", "True"),
        (conf(tensor="x"), "trainer.parallelism.tensor", "'x'"),
        (conf(tensor=2.0), "trainer.parallelism.tensor", "2.0"),
        (conf(domain=2.5), "trainer.parallelism.domain", "2.5"),
        (conf(domain=None), "trainer.parallelism.domain", "None"),
        ({"trainer": {"parallelism": [1, 2]}}, "trainer.parallelism", "[1, 2]"),
    ],
)
def test_bad_blocks_raise_value_error_naming_key_and_value(full, key, value):
    with pytest.raises(ValueError) as err:
        parse_parallelism_conf(full)
    assert key in str(err.value)
    assert value in str(err.value)


def test_load_config_reads_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  parallelism: {data: ddp, tensor: 2, domain: '2'}\n")
    assert parse_parallelism_conf(load_config(p)) == {"data": "ddp", "tensor": 2, "domain": 2}


def test_load_config_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_load_config_invalid_yaml_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("trainer:\n  parallelism: {data: ddp\n  x: [\n")
    with pytest.raises(ValueError, match=r"invalid YAML in .*bad.yaml at line"):
        load_config(p)


def test_load_config_refuses_python_tags(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("trainer: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        load_config(p)


def test_parallel_dims_arithmetic():
    d = ParallelDims.from_block({"data": "fsdp2", "tensor": 2, "domain": 2}, 8)
    assert d.dp == 2 and d.mesh_axes == (("dp", 2), ("tp", 2), ("domain", 2))
    assert ParallelDims.from_block({"data": "none", "domain": 4}, 4).mesh_axes == (("domain", 4),)
    assert ParallelDims.from_block({"data": "fsdp2"}, 1).mesh_axes == (("dp", 1),)
    with pytest.raises(ValueError, match="not divisible"):
        ParallelDims.from_block({"tensor": 4}, 6)
