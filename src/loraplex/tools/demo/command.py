"""``loraplex demo``: serve the embedded demo (SmolLM2-135M-Instruct with the shipped adapters),
ask it one question per model (``--check``), or run the offline random-model check (``--random``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """``loraplex demo``'s flags."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--cache-dir", default=None, help="default: $LORAPLEX_CACHE_DIR or ~/.cache/loraplex"
    )
    parser.add_argument(
        "--check", action="store_true", help="ask each model one question, then exit"
    )
    parser.add_argument(
        "--random",
        action="store_true",
        help="no download: a random model (--arch) + 4 random adapters, one mixed batch checked against PEFT",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="with --random")
    parser.add_argument(
        "--arch",
        default="llama",
        help="with --random: the architecture of the random model (llama, mistral, qwen2, "
        "qwen3, gemma2, gemma3_text, gemma3, phi3, qwen3_moe, mixtral, smollm3, qwen3_5, "
        "qwen3_5_moe, gemma4_text, gemma4_moe_text, llama4_text, gpt_oss; the multimodal "
        "wrappers qwen3_5_vl, qwen3_5_moe_vl, gemma3, gemma4, gemma4_moe, llama4)",
    )


_DEMO_QUESTION = "What is the capital of France?"


def _demo_prompt(model_dir: Path) -> str:
    """The demo question as the model's chat template renders it: the completion prompt in
    which the demo adapters (trained on chat-formatted answers) show their effect."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(
        [{"role": "user", "content": _DEMO_QUESTION}], tokenize=False, add_generation_prompt=True
    )
    return str(text)


def _shell_json(body: dict[str, object]) -> str:
    """``body`` as JSON inside single quotes for a POSIX shell."""
    return "'" + json.dumps(body).replace("'", "'\\''") + "'"


def _demo_examples(url: str, base: str, adapters: list[str], prompt: str) -> str:
    """Copy-paste curl and openai examples for the running demo: for each model a chat request
    and a completion whose prompt is the chat-formatted question (``prompt``), so each
    adapter's effect shows in both."""
    names = ", ".join([base, *adapters])
    models = [base, *adapters]
    chat = {"messages": [{"role": "user", "content": _DEMO_QUESTION}], "max_tokens": 40,
            "temperature": 0}  # fmt: skip
    completion = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    lines = [
        "",
        f"loraplex demo is serving on {url}  (models: {names})",
        "",
        'Chat with any model (change "model" to any name above):',
        "",
    ]
    for m in models:
        lines.append(
            f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d {_shell_json({'model': m, **chat})}"
        )
    lines += [
        "",
        "Completions: the demo adapters learned their style on chat-formatted answers, so a",
        "completion shows it when the prompt is the chat template's text (a bare prompt such as",
        '"The sky is" is continued the way the base model would):',
        "",
    ]
    for m in models:
        lines.append(
            f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' "
            f"-d {_shell_json({'model': m, **completion})}"
        )
    lines += [
        "",
        "or with the openai client (pip install openai):",
        "",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{url}/v1", api_key="unused")',
        f"  prompt = {prompt!r}",
        f"  for model in {models!r}:",
        "      chat = client.chat.completions.create(model=model, temperature=0, max_tokens=40,",
        f'          messages=[{{"role": "user", "content": "{_DEMO_QUESTION}"}}])',
        "      text = client.completions.create(model=model, temperature=0, max_tokens=40,",
        "          prompt=prompt)",
        "      print(model, '->', chat.choices[0].message.content, '|', text.choices[0].text)",
        "",
        f"Residency of each adapter: curl -s {url}/v1/adapters   Metrics: curl -s {url}/metrics",
        "Stop with Ctrl-C.",
        "",
    ]
    return "\n".join(lines)


def _demo_ask(url: str, models: list[str], prompt: str) -> list[tuple[str, str, str]]:
    """One greedy chat request and one greedy completion of the chat-formatted ``prompt`` per
    model through the HTTP API: (model, chat answer, completion text)."""
    import httpx

    out = []
    with httpx.Client(base_url=url, timeout=300) as c:
        for m in models:
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": m,
                    "messages": [{"role": "user", "content": _DEMO_QUESTION}],
                    "max_tokens": 40,
                    "temperature": 0,
                },
            )
            r.raise_for_status()
            chat = r.json()["choices"][0]["message"]["content"]
            r = c.post(
                "/v1/completions",
                json={"model": m, "prompt": prompt, "max_tokens": 40, "temperature": 0},
            )
            r.raise_for_status()
            out.append((m, chat, r.json()["choices"][0]["text"]))
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    """Serve SmolLM2-135M-Instruct with the shipped demo adapters (``--random``: the offline
    random-model check instead)."""
    if args.random:
        return cmd_demo_random(args)
    from loraplex.config import EngineConfig, LoRAModule, ServerConfig
    from loraplex.server.app import create_app, run_server
    from loraplex.tools.demo import demo_adapter_dirs, prepare_demo_model

    cache = Path(args.cache_dir).expanduser() if args.cache_dir else None
    model_dir = prepare_demo_model(cache, progress=True)
    adapters = demo_adapter_dirs()
    base = "smollm2-135m-instruct"
    config = ServerConfig(
        engine=EngineConfig(
            model=str(model_dir),
            enable_lora=True,
            max_loras=4,
            max_lora_rank=16,
            max_model_len=2048,
            max_num_seqs=32,
        ),
        host=args.host,
        port=args.port,
        served_model_name=[base],
        lora_modules=[LoRAModule(n, str(p), base) for n, p in adapters.items()],
    )
    names = list(adapters)
    prompt = _demo_prompt(model_dir)
    if args.check:  # answer one question per model through HTTP, then exit
        from loraplex.testing.server import serve_in_thread

        print(f"loading {model_dir} ...")
        with serve_in_thread(create_app(config), timeout=300) as url:
            for model, chat, text in _demo_ask(url, [base, *names], prompt):
                print(f"[{model}] chat: {chat!r}")
                print(f"[{model}] completion: {text!r}")
        return 0
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    print(f"loading {model_dir} ...")
    examples = _demo_examples(url, base, names, prompt)
    run_server(config, on_ready=lambda: print(examples, flush=True))
    return 0


def cmd_demo_random(args: argparse.Namespace) -> int:
    """Build (once) a small random model of ``--arch`` and four PEFT adapters, then run one
    mixed batch and check it against transformers + PEFT."""
    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.lora.peft.files import CONFIG_NAME
    from loraplex.testing import (
        ARCH_CONFIGS,
        load_merged_reference,
        make_random_adapter,
        make_random_model,
        reference_greedy,
    )
    from loraplex.tools.demo.prepare import default_cache_dir

    arch = args.arch
    if arch not in ARCH_CONFIGS:
        print(
            f"loraplex demo: --arch {arch!r} is not one of {', '.join(ARCH_CONFIGS)}",
            file=sys.stderr,
        )
        return 2
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    root = cache / ("demo-random" if arch == "llama" else f"demo-random-{arch}")
    model_dir = root / "model"
    if not (model_dir / "config.json").is_file():
        print(f"building a random {arch} model (h256, 4 layers, GQA) in {model_dir} ...")
        make_random_model(
            model_dir,
            arch,
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=768,
            seed=0,
        )
    # targets every architecture names alike (Phi-3's fused qkv_proj / gate_up_proj included),
    # in the language model only (a multimodal checkpoint's vision tower has its own q_proj)
    text = r"(?:.*language_model\.|model\.)layers"
    specs = {
        "all-r8": dict(r=8, target_modules="all-linear", seed=1),
        "attn-r16": dict(r=16, target_modules=rf"{text}\.\d+\.self_attn\.\w+_proj", seed=2),
        "layer1-r4-rslora": dict(
            r=4, target_modules=rf"{text}\.1\.\w+\.\w+_proj", use_rslora=True, seed=3
        ),
        "vocab-r32": dict(r=32, target_modules=["lm_head", "embed_tokens"], seed=4),
    }
    loras: list[LoRARequest | None] = [None]
    for name, kw in specs.items():
        d = root / "adapters" / name
        if not (d / CONFIG_NAME).is_file():
            make_random_adapter(model_dir, d, **kw)
        loras.append(LoRARequest(name, d))
    llm = LLM(str(model_dir), max_loras=4, dtype="auto")
    prompts = ["What is the capital of France?", "def add(a, b):"]
    batch_p = [p for p in prompts for _ in loras]
    batch_l = [lr for _ in prompts for lr in loras]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch_p, params, lora_request=batch_l)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"one mixed batch: {len(outs)} requests, base + {len(loras) - 1} adapters "
        f"(random weights, so the text is noise): {ntok} tokens in {dt:.2f}s = {ntok / dt:.1f} tok/s"
    )
    print("checking each output against transformers + PEFT with that adapter merged ...")
    tok = llm.get_tokenizer()
    ok = True
    for prompt, lr, out in zip(batch_p, batch_l, outs, strict=True):
        ref = load_merged_reference(model_dir, lr.path if lr else None)
        want, _ = reference_greedy(ref, tok(prompt).input_ids, len(out.outputs[0].token_ids))
        same = want == out.outputs[0].token_ids
        ok &= same
        who = out.adapter.short if out.adapter else "base"
        print(f"  {'equal' if same else 'DIFFERENT':<9} {who:<42} {prompt!r}")
    print(f"all KV blocks and slots free afterwards: {llm.engine.is_idle()}")
    return 0 if ok else 1
