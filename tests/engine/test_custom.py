"""engine/custom.py: the contract of a user's batched model, as the engine Ferry wraps it in
checks it: declarations, per-input failures, outputs checked against their declarations."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from engine.custom import (
    CustomEngine,
    CustomModelError,
    CustomResult,
    Row,
    Tensor,
    find_class,
    load_custom,
    pack_value,
    unpack_value,
)


def rows(*texts: str, vector: tuple[float, ...] = (1.0, 2.0)) -> list[Row]:
    return [Row({"text": pack_value("BYTES", t), "vector": pack_value("FP32", list(vector))}) for t in texts]


def fake_engine(**kw: Any) -> CustomEngine:
    return load_custom("engine.fake:FakeCustomModel", "fake-custom", options=kw)


def test_a_class_is_loaded_from_its_source_with_its_options_on_its_device():
    engine = fake_engine(delay=0.0)
    assert engine.name == "fake-custom" and engine.model.loaded_on == ("cpu", "auto")
    assert [t.name for t in engine.inputs] == ["text", "vector"]
    assert engine.facts()["outputs"] == [["length", "INT64", []], ["sum", "FP32", []], ["upper", "BYTES", []]]


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("engine.fake", "package.module:ClassName"),
        ("engine.fake:NoSuchClass", "has no 'NoSuchClass'"),
        ("engine.fake:fake_tokens", "is not a class"),
        ("engine.fake:FakeEmbeddingEngine", r"no predict\(batch\) method"),
    ],
)
def test_a_source_that_names_no_batched_model_says_what_is_wrong(source, words):
    with pytest.raises(CustomModelError, match=words):
        load_custom(source, "m")


def test_a_missing_module_is_the_import_error_itself():
    with pytest.raises(ModuleNotFoundError):
        find_class("no_such_module_here:Model")


class Undeclared:
    inputs: ClassVar[list[Any]] = []
    outputs: ClassVar = [Tensor("y", "FP32")]

    def predict(self, batch):
        return batch


def test_declarations_are_checked_at_load():
    with pytest.raises(CustomModelError, match="declares no inputs"):
        load_custom(f"{__name__}:Undeclared", "m")
    with pytest.raises(CustomModelError, match="datatype 'FLOAT'"):
        Tensor("x", "FLOAT")
    with pytest.raises(CustomModelError, match="shape"):
        Tensor("x", "FP32", (-2,))
    assert Tensor.of({"name": "x", "datatype": "INT8", "shape": [3]}) == Tensor("x", "INT8", (3,))
    assert Tensor.of(("x", "BYTES")).describe() == {"name": "x", "datatype": "BYTES", "shape": [-1]}


def test_rows_reach_the_model_as_numpy_arrays_and_text():
    seen: list[dict[str, Any]] = []
    engine = fake_engine()
    original = engine.model.predict

    def spy(batch):
        seen.extend(batch)
        return original(batch)

    engine.model.predict = spy
    [result] = engine.predict(rows("héllo", vector=(1.5, 2.5, 3.0)))
    assert seen[0]["text"] == "héllo"
    assert isinstance(seen[0]["vector"], np.ndarray) and seen[0]["vector"].dtype == np.float32
    assert isinstance(result, CustomResult)
    assert unpack_value(result.outputs["length"]) == 5 and unpack_value(result.outputs["sum"]) == pytest.approx(7.0)
    assert unpack_value(result.outputs["upper"]) == "HÉLLO"


def test_one_failing_input_fails_alone():
    out = fake_engine().predict(rows("fine", "FAIL_ITEM here", "also fine"))
    assert isinstance(out[1], ValueError)
    assert [unpack_value(o.outputs["upper"]) for o in (out[0], out[2])] == ["FINE", "ALSO FINE"]  # type: ignore[union-attr]


class Sloppy:
    """Returns outputs that break its declaration in a different way per input."""

    inputs: ClassVar = [Tensor("x", "INT32")]
    outputs: ClassVar = [Tensor("y", "FP32", (2,))]

    def predict(self, batch):
        answers = {0: {"y": [1.0, 2.0]}, 1: {"y": [1.0, 2.0, 3.0]}, 2: {"z": [1.0, 2.0]}, 3: {"y": ["a", "b"]}, 4: 7}
        return [answers[int(row["x"])] for row in batch]


def test_an_output_that_breaks_its_declaration_fails_that_input_only():
    engine = load_custom(f"{__name__}:Sloppy", "sloppy")
    out = engine.predict([Row({"x": pack_value("INT32", i)}) for i in range(5)])
    assert isinstance(out[0], CustomResult) and unpack_value(out[0].outputs["y"]).tolist() == [1.0, 2.0]
    assert all(isinstance(o, CustomModelError) for o in out[1:])
    assert "shape [3], declared [2]" in str(out[1]) and "lacks ['y']" in str(out[2])
    assert "holds numbers" in str(out[3]) and "is a dict" in str(out[4])


def test_a_model_that_answers_the_wrong_number_of_outputs_fails_the_batch():
    engine = fake_engine()
    engine.model.predict = lambda batch: batch[:1]
    with pytest.raises(CustomModelError, match="took 2 inputs and returned 1 outputs"):
        engine.predict(rows("a", "b"))


def test_cost_hints_come_from_the_class_and_are_at_least_one():
    assert fake_engine().costs(rows("", "x" * 40)) == [1, 6]
    assert load_custom(f"{__name__}:Sloppy", "m").costs([Row({"x": pack_value("INT32", 0)})]) is None  # no hint


def test_packed_values_round_trip_every_datatype():
    for datatype, value in [("BOOL", [True, False]), ("UINT8", [0, 255]), ("INT64", [[-1, 2], [3, 4]]), ("FP16", 1.5)]:
        got = unpack_value(pack_value(datatype, value))
        assert np.asarray(got).tolist() == value
    assert unpack_value(pack_value("BYTES", [b"\xff", "ok"])).tolist() == [b"\xff", "ok"]  # not UTF-8 stays bytes
    with pytest.raises(ValueError, match="str or bytes"):
        pack_value("BYTES", [1])
