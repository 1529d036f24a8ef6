"""How a checkpoint's bytes are read and staged, in process: a one-process run's model.safetensors straight into the
model (and left to accelerate where the file does not match it exactly), the files each rank asks the kernel to
read ahead, the storage record found in a DCP item without `zipfile`, a ZeRO rank's range read straight into its
flat state, and a ZeRO rank's rows staged from their pieces for a background write."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from neox_hf.checkpoint.in_place import ModelReadBeside, read_model_in_place
from neox_hf.checkpoint.layout_free import (Chunk, _reader_class, _record_start, _storage_record, load_layout_free,
                                            save_layout_free)
from neox_hf.checkpoint.readahead import files_a_rank_reads


def _neox() -> GPTNeoXForCausalLM:
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=64))


def _tied_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True))


@pytest.mark.parametrize("build", [_neox, _tied_llama], ids=["gpt-neox", "llama-tied"])
def test_a_one_process_checkpoints_weights_are_read_into_the_models_own_memory(build, tmp_path):
    """What accelerate's save_state writes (safetensors' `save_model`, tied weights stored once) read back into
    another model of the same config: every tensor equal to the saved one, each in the memory it had before, and the
    hook takes the model off accelerate's list so accelerate does not load it again."""
    torch.manual_seed(0)
    saved, other = build(), build()
    save_model(saved, str(tmp_path / "model.safetensors"))
    before = {name: tensor.data_ptr() for name, tensor in other.state_dict().items()}
    models, hook = [other], ModelReadBeside()
    hook(models, str(tmp_path))
    assert models == []
    hook.wait()
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, saved.state_dict()[name]), name
        assert tensor.data_ptr() == before[name], name


def test_a_model_that_does_not_match_the_file_is_left_to_accelerate(tmp_path):
    """Another shape, another dtype, or a parameter the file lacks: nothing is read (the model unchanged) and the
    model stays on accelerate's list, whose load names the difference."""
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_model(_neox(), str(path))
    wider = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, max_position_embeddings=64))
    for model in (wider, _neox().to(torch.bfloat16), _tied_llama()):
        unchanged = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        assert not read_model_in_place(model, path)
        assert all(torch.equal(unchanged[name], tensor) for name, tensor in model.state_dict().items())
        models, hook = [model], ModelReadBeside()
        hook(models, str(tmp_path))
        assert models == [model]
        hook.wait()


def test_a_truncated_weights_file_is_left_to_accelerate_to_name(tmp_path):
    path = tmp_path / "model.safetensors"
    save_model(_neox(), str(path))
    path.write_bytes(path.read_bytes()[:-100])
    assert not read_model_in_place(_neox(), path)


def test_each_rank_reads_ahead_only_its_own_files_and_the_shared_ones(tmp_path):
    """Its trainer and RNG state, the step's config, DCP's metadata and a one-process run's model and optimizer
    files; not the other ranks' files, the tokenizer or DCP's tensor files (its reader asks for the items it reads)."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "trainer_state_rank0.pt",
                 "trainer_state_rank1.pt", "random_states_0.pkl", "random_states_1.pkl", "model.safetensors",
                 "optimizer.bin", "layout_free/.metadata", "layout_free/__0_0.distcp", "layout_free/__1_0.distcp"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in files_a_rank_reads(tmp_path, 1)) == [
        "config.json", "layout_free/.metadata", "model.safetensors", "optimizer.bin", "random_states_1.pkl",
        "trainer_state_rank1.pt"]


def test_the_storage_record_of_every_dcp_item_is_where_zipfile_finds_it(tmp_path):
    """For every item of a layout-free state (tensors of several shapes and dtypes, one empty), the record start and
    size read from the item's central directory, and the start found from the item's first bytes, equal what
    `zipfile` reads from the whole item; bytes that are no such zip give None (DCP's own read then handles the
    item)."""
    torch.manual_seed(0)
    tensors = {"model/a": torch.randn(300, 17), "model/b": torch.randn(5), "exp_avg/c": torch.zeros(0, 3),
               "exp_avg_sq/d": torch.randn(2, 3, 4).to(torch.bfloat16)}
    save_layout_free(tensors, tmp_path)
    reader = _reader_class()(str(tmp_path / "layout_free"))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    for index, stored in reader.storage_data.items():
        with open(tmp_path / "layout_free" / stored.relative_path, "rb", buffering=0) as stream:
            stream.seek(stored.offset)
            item = stream.read(stored.length)
            with zipfile.ZipFile(io.BytesIO(item)) as archive:
                (record,) = [info for info in archive.infolist() if "/data/" in info.filename]
            names, extras = struct.unpack("<HH", item[record.header_offset + 26:record.header_offset + 30])
            assert _storage_record(stream, stored.offset, stored.length) == (
                record.header_offset + 30 + names + extras, record.file_size), index.fqn
            assert _record_start(stream, stored.offset, stored.length) == record.header_offset + 30 + names + extras
    garbage = tmp_path / "garbage"
    garbage.write_bytes(bytes(range(256)) * 40)
    with open(garbage, "rb", buffering=0) as stream:
        assert _storage_record(stream, 100, 5000) is None
        assert _storage_record(stream, 0, 10) is None
        assert _record_start(stream, 100, 5000) is None


@pytest.mark.parametrize("columns", ["all", "the right half"])
def test_a_range_of_rows_is_read_straight_into_its_flat_tensor(columns, tmp_path):
    """What a ZeRO-1/2 rank reads of a moment: elements [skip, skip + n) of its box of rows, into the 1-D fragment
    of the optimizer's flat state. Whole stored rows: read from the file straight into the fragment, no box
    allocated. Part of each stored row (a box of the right half of the columns): DCP reads the box and the range is
    copied out of it. Either way the fragment holds exactly those elements and nothing around it changes."""
    torch.manual_seed(0)
    full = torch.randn(40, 6)
    save_layout_free({"exp_avg/w": full}, tmp_path)
    cols = slice(0, 6) if columns == "all" else slice(3, 6)
    box = full[7:19, cols]  # rows 7-18 of the box's columns
    state = torch.full((100,), -1.0)
    fragment = state[20:20 + box.numel() - 8]  # a range starting 5 elements into the box, ending 3 before its end
    chunk = Chunk.into_flat(fragment, 5, box.shape, (7, cols.start), full.shape)
    load_layout_free({"exp_avg/w": chunk}, tmp_path)
    assert torch.equal(fragment, box.reshape(-1)[5:5 + fragment.numel()])
    assert (state[:20] == -1).all() and (state[20 + fragment.numel():] == -1).all()
    assert chunk.direct  # every read covers whole rows of the box
    assert (chunk._local is None) == (columns == "all")  # the box itself allocated only for DCP's own read


def test_a_one_process_checkpoints_optimizer_state_is_read_into_the_tensors_the_optimizer_holds(tmp_path):
    """What accelerate's load does with the optimizer file mapped (`torch.load(mmap=True)` + `load_state_dict`),
    then `into_held_memory`: every moment and step equal to the saved ones, in the memory the optimizer held before
    the load (for a state it did not hold yet: memory of its own), none left on the file's mapping."""
    from neox_hf.checkpoint.in_place import _file_offsets, into_held_memory, optimizer_state_tensors

    torch.manual_seed(0)
    model = _neox()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")
    saved = {(id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items()}
    first = next(iter(optimizer.state))
    del optimizer.state[first]  # a state the optimizer does not hold yet
    held = optimizer_state_tensors([optimizer])
    for state in optimizer.state.values():
        for value in state.values():
            value.zero_()
    mapped = torch.load(tmp_path / "optimizer.bin", mmap=True, weights_only=True)
    assert len(_file_offsets(tmp_path / "optimizer.bin", [v for s in mapped["state"].values() for v in s.values()])) \
        == len(saved)
    optimizer.load_state_dict(mapped)
    into_held_memory([optimizer], held, tmp_path)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(value, saved[(id(param), key)]), key
            home = held.get((0, id(param), key))
            assert (value is home) if param is not first else home is None
    on_the_file = {value.untyped_storage().data_ptr() for s in mapped["state"].values() for value in s.values()}
    assert not on_the_file & {value.untyped_storage().data_ptr() for s in optimizer.state.values()
                              for value in s.values()}


def test_rows_made_of_pieces_are_staged_into_one_host_buffer_and_saved_as_the_joined_rows(tmp_path):
    """A ZeRO-1/2 rank's rows for a save: its range (a view of the optimizer's flat state) and the next rank's first
    elements. The host copy copies the pieces into one buffer of the box, kept from one save to the next; what it
    staged no longer follows the state (the optimizer may step); a foreground save joins them; either way the
    layout-free state holds exactly the joined rows."""
    from neox_hf.checkpoint.background import HostCopies

    torch.manual_seed(0)
    state, tail = torch.randn(50), torch.randn(4)
    chunk = Chunk.joined([state[6:], tail], (6, 8), (10, 0), (30, 8))  # rows 10-15 of a 30 × 8 tensor
    joined = torch.cat([state[6:], tail]).view(6, 8)
    copies = HostCopies(pinned=False)
    staged = copies.stage({"exp_avg/w": chunk})["exp_avg/w"]
    assert torch.equal(staged.local, joined) and chunk._local is None  # nothing joined on the way
    buffer = staged.local.data_ptr()
    state += 1
    assert torch.equal(staged.local, joined)
    assert copies.stage({"exp_avg/w": chunk})["exp_avg/w"].local.data_ptr() == buffer
    for name, saved in (("staged", staged), ("foreground", Chunk.joined([state[6:], tail], (6, 8), (10, 0), (30, 8)))):
        rows = torch.full((6, 8), -1.0)
        save_layout_free({"exp_avg/w": saved}, tmp_path / name)
        load_layout_free({"exp_avg/w": Chunk(rows, (10, 0), (30, 8))}, tmp_path / name)
        assert torch.equal(rows, saved.local), name
