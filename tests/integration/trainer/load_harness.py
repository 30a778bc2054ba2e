"""A torchrun harness: `load.load_sharded_model` on N ranks against the folder and a plain HF model.

    torchrun --nproc_per_node 2 tests/integration/trainer/load_harness.py --model DIR --tied DIR --out r2.pt

Each rank loads the policy, the LoRA policy, the reference (bf16 and fp32), the critic (`--model`) and
a tied-embedding policy (`--tied`) and checks, raising on the first difference:
- every full parameter (`weights.full_params`) equals the folder's tensor (the reference's: cast to bf16;
  the critic's new head: what `from_pretrained` draws from the same seed);
- the log-probs of a fixed sequence equal a plain HF model's (1e-6, fp32);
- the reference holds bf16 parameters (fp32 buffers) when the dtype is bf16;
- the tied model's head is its embedding (one parameter).
Rank 0 writes `--out` (torch.save): the world size and what is drawn rather than read (the critic's
head, the LoRA adapters), which the test compares between 1 and 2 ranks.
Boundary: outside the package on purpose (a harness, not a component).
"""

from __future__ import annotations

import argparse

import torch

SEQ = [1, 40, 41, 42, 43, 29, 44, 45, 2]
"""The fixed sequence scored (token ids of the tiny model's vocabulary)."""


def folder_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    return torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]


def check_params(model, want: dict[str, torch.Tensor], dtype: torch.dtype, what: str, skip: tuple[str, ...] = ()) -> None:
    from asyncrl.trainer.weights import full_params

    seen = set()
    for name, t in full_params(model, dtype):
        seen.add(name)
        if name.startswith(skip):
            continue
        assert name in want, f"{what}: {name} is not in the folder"
        assert torch.equal(t, want[name].to(dtype)), f"{what}: {name} differs from the folder's tensor"
    assert {n for n in want if not n.startswith(skip)} <= seen | {"lm_head.weight"}, f"{what}: tensors not loaded"


def main(argv: list[str] | None = None) -> None:
    from asyncrl.hf_imports import skip_unused_backends
    from asyncrl.trainer.setup import close_process_group, ensure_process_group

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the tiny model's folder (untied head)")
    ap.add_argument("--tied", required=True, help="a folder of a model with tie_word_embeddings")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    skip_unused_backends()
    owns = ensure_process_group(torch.device("cpu"))
    try:
        check(args)  # its models are gone when it returns: freed with the group alive
    finally:
        if owns:
            close_process_group()


def check(args: argparse.Namespace) -> None:
    from asyncrl.trainer.lora import LoraSpec
    from asyncrl.trainer.load import load_sharded_model
    from asyncrl.trainer.weights import full_params
    import transformers

    cpu = torch.device("cpu")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    want = folder_tensors(args.model)
    ids = torch.tensor([SEQ])
    plain = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    policy = load_sharded_model(args.model, cpu, torch.float32, trainable=True)
    check_params(policy, want, torch.float32, "policy")
    diff = (logprobs(policy, ids) - logprobs(plain, ids)).abs().max().item()
    assert diff <= 1e-6, f"policy log-probs differ from a plain HF model's by {diff}"
    assert all(p.requires_grad for p in policy.parameters())
    for (name, b), (_, b0) in zip(policy.named_buffers(), plain.named_buffers(), strict=True):
        assert torch.equal(b, b0) and b.dtype == torch.float32, f"buffer {name} differs from from_pretrained's"

    ref = load_sharded_model(args.model, cpu, torch.bfloat16, trainable=False)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}, "the bf16 reference holds other dtypes"
    assert {b.dtype for b in ref.buffers()} == {torch.float32} and not any(p.requires_grad for p in ref.parameters())
    check_params(ref, want, torch.bfloat16, "reference (bf16)")
    ref32 = load_sharded_model(args.model, cpu, torch.float32, trainable=False)
    assert {p.dtype for p in ref32.parameters()} == {torch.float32}
    check_params(ref32, want, torch.float32, "reference (fp32)")

    torch.manual_seed(3)
    lora = load_sharded_model(args.model, cpu, torch.float32, trainable=True, lora=LoraSpec(rank=4, alpha=8))
    check_params(lora, want, torch.float32, "LoRA policy")  # merged: B starts at 0
    adapters = {n: p.full_tensor() for n, p in lora.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert all(not t.any() for n, t in adapters.items() if ".lora_B." in n)
    assert all(t.std() > 0 for n, t in adapters.items() if ".lora_A." in n)
    diff = (logprobs(lora, ids) - logprobs(plain, ids)).abs().max().item()
    assert diff <= 1e-6, f"LoRA policy log-probs differ from a plain HF model's by {diff}"

    torch.manual_seed(5)
    critic = load_sharded_model(args.model, cpu, torch.float32, trainable=True, auto_class="AutoModelForTokenClassification")
    torch.manual_seed(5)
    old = transformers.AutoModelForTokenClassification.from_pretrained(args.model, dtype=torch.float32, num_labels=1)
    old_sd = old.state_dict()
    check_params(critic, want, torch.float32, "critic", skip=("score.",))
    head = {n: t for n, t in full_params(critic, torch.float32) if n.startswith("score.")}
    assert set(head) == {"score.weight", "score.bias"}
    assert all(torch.equal(t, old_sd[n]) for n, t in head.items()), "the critic's head is not from_pretrained's draw"
    with torch.no_grad():
        v, v0 = critic(input_ids=ids).logits, old(input_ids=ids).logits
    assert (v - v0).abs().max().item() <= 1e-6

    tied = load_sharded_model(args.tied, cpu, torch.float32, trainable=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight, "the tied head is no longer the embedding"
    tied_want = folder_tensors(args.tied)
    tied_want.setdefault("lm_head.weight", tied_want["model.embed_tokens.weight"])  # saved once
    check_params(tied, tied_want, torch.float32, "tied policy")
    plain_tied = transformers.AutoModelForCausalLM.from_pretrained(args.tied, dtype=torch.float32).eval()
    diff = (logprobs(tied, ids) - logprobs(plain_tied, ids)).abs().max().item()
    assert diff <= 1e-6, f"tied log-probs differ from a plain HF model's by {diff}"

    if rank == 0:
        torch.save({"world": world, "head": head, "adapters": adapters}, args.out)
    print(f"rank {rank}/{world}: loads match the folders", flush=True)


if __name__ == "__main__":
    main()
