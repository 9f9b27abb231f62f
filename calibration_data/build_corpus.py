"""Build quantkit's calibration corpus (`default.jsonl`) and its held-out twin (`heldout.jsonl`).

Every sentence, snippet and template below was written for quantkit (CC0). The generator mixes them
with a seeded RNG so the corpus covers the genres a chat-tuned MoE model sees in production — chat
turns with tool calls, code, math word problems with worked answers, long technical documents, and
Korean / Chinese / English prose — while staying small enough to commit (a few hundred KB).

    python calibration_data/build_corpus.py            # rewrites both files, byte-identical each run
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

NAMES = ["Mina", "Jun", "Priya", "Tomas", "Aiko", "Omar", "Lena", "Wei", "Sofia", "Ravi", "Hana", "Diego"]
CITIES = ["Seoul", "Busan", "Shanghai", "Chengdu", "Lisbon", "Nairobi", "Oslo", "Lima", "Osaka", "Austin"]
ITEMS = ["apples", "notebooks", "bolts", "tickets", "bottles", "cables", "lanterns", "pencils", "tiles"]
TOPICS = [
    "quantization",
    "kv cache",
    "tensor parallelism",
    "mixture of experts",
    "speculative decoding",
    "checkpoint sharding",
]

# ---------------------------------------------------------------------------------------------- prose
EN_PARAS = [
    "A large language model spends most of its decode time reading weights from memory. When every "
    "generated token touches every weight, halving the bytes per weight nearly halves the time spent "
    "waiting on memory, which is why four-bit weights speed up decoding even though the arithmetic "
    "is unchanged.",
    "The key-value cache grows with every token of every request. At long context lengths it, and not "
    "the weights, decides how many requests fit on a node. Storing the cache in eight-bit floating "
    "point doubles the number of tokens the same memory can hold.",
    "A mixture-of-experts layer sends each token to a handful of experts chosen by a small router. "
    "Most experts see only a small share of the traffic, and a few may see almost none during a short "
    "calibration run, which is why a careful tool reports how many tokens each expert received.",
    "Group-wise quantization splits each row of a weight matrix into short runs of thirty-two values "
    "and stores one scale per run. A small group follows the local range of the weights closely, so a "
    "single large value spoils only its own group instead of the whole row.",
    "GPTQ quantizes the columns of a weight matrix one at a time and, after each column, adjusts the "
    "columns that are still unquantized so that the layer's output on real inputs changes as little "
    "as possible. The inverse Hessian of the inputs tells it how to spread each rounding error.",
    "Before a long conversion, an engineer wants to know three things: whether the result will load in "
    "the serving engine, whether it will fit in the memory of the node, and how much accuracy it will "
    "cost. A tool that answers all three before spending hours of compute saves a great deal of time.",
    "The harbour was quiet in the early morning. Fishing boats rocked against the pier while gulls "
    "argued over the remains of last night's catch, and the smell of diesel and salt hung in the cold air.",
    "Good documentation answers the question the reader actually has. It starts with what the tool "
    "does, shows the command that does it, and explains what the output means, in that order.",
    "When the power failed at three in the morning, the conversion job had finished forty of its "
    "sixty layers. Because every finished layer had been written to disk with a checksum, the rerun "
    "picked up at layer forty-one and the night's work was not lost.",
    "Rivers carry sediment from the mountains to the sea. Over thousands of years the deposits build "
    "deltas, fertile plains where farmers have grown rice, wheat and cotton since the first cities.",
    "A careful baker weighs flour instead of measuring it by the cup, because a cup of flour can vary "
    "by a fifth depending on how tightly it is packed. The same care with units avoids many bugs.",
    "Latent attention compresses the keys and values of each token into one short vector plus a small "
    "rotary part. The serving engine caches that vector directly, so a single scale per layer covers "
    "everything the cache stores.",
]
KO_PARAS = [
    "대형 언어 모델은 토큰을 하나 생성할 때마다 모든 가중치를 메모리에서 읽어야 합니다. 그래서 가중치를 "
    "4비트로 줄이면 계산량은 같아도 디코딩 속도가 크게 빨라집니다.",
    "키-값 캐시는 요청마다, 토큰마다 계속 늘어납니다. 긴 문맥에서는 가중치보다 캐시가 먼저 GPU 메모리를 "
    "채우기 때문에 FP8 캐시를 쓰면 같은 메모리에 두 배의 토큰을 담을 수 있습니다.",
    "오늘 아침 서울에는 가을비가 조용히 내렸습니다. 사람들은 우산을 쓰고 지하철역으로 서둘러 걸어갔고, "
    "카페 창문에는 김이 서려 있었습니다.",
    "전문가 혼합 모델에서는 라우터가 각 토큰을 몇 개의 전문가에게만 보냅니다. 보정 데이터가 적으면 어떤 "
    "전문가는 토큰을 거의 받지 못하므로, 도구가 전문가별 통계를 보고해야 합니다.",
    "할머니는 김치를 담글 때 배추를 소금물에 하룻밤 절여 두셨습니다. 다음 날 아침 양념을 버무리면 온 "
    "집안에 마늘과 고춧가루 냄새가 가득했습니다.",
    "체크포인트 변환은 몇 시간씩 걸리기 때문에 중간에 멈추더라도 마지막으로 끝난 층부터 다시 시작할 수 "
    "있어야 합니다.",
]
ZH_PARAS = [
    "大型语言模型在解码时，每生成一个词元都要从显存中读取全部权重。把权重压缩到四位之后，计算量不变，"
    "但读取的数据减少了一半以上，所以解码速度明显提高。",
    "键值缓存随着每个请求、每个词元不断增长。在长上下文场景下，先占满显存的往往是缓存而不是权重，"
    "因此使用八位浮点缓存可以让同样的显存容纳两倍的词元。",
    "混合专家模型中的路由器只把每个词元发送给少数几个专家。校准数据较少时，有些专家几乎收不到词元，"
    "所以量化工具应当报告每个专家实际收到了多少词元。",
    "清晨的西湖笼罩在薄雾之中，远处的山影若隐若现。几只小船慢慢划过湖面，船夫哼着古老的歌谣。",
    "分组量化把权重矩阵的每一行分成三十二个数一组，每组保存一个缩放因子。组越小，误差越小，"
    "但需要保存的缩放因子也越多。",
    "转换一个几百吉字节的模型需要好几个小时，所以程序必须能在崩溃之后从最后完成的那一层继续运行。",
]


def prose(rng: random.Random, paras: list[str], lo: int, hi: int) -> str:
    """A document of `lo..hi` paragraphs drawn without replacement from `paras`."""
    k = rng.randint(lo, min(hi, len(paras)))
    return "\n\n".join(rng.sample(paras, k))


def long_document(rng: random.Random) -> str:
    """A multi-section technical note mixing English prose with a table and a list."""
    topic = rng.choice(TOPICS)
    title = f"# Notes on {topic}\n\n"
    body = prose(rng, EN_PARAS, 4, 8)
    rows = "\n".join(
        f"| {rng.choice(CITIES)} | {rng.randint(8, 512)} GB | {rng.randint(1, 64)} GPUs | "
        f"{rng.randint(100, 9000)} tok/s |"
        for _ in range(rng.randint(3, 6))
    )
    table = f"\n\n| site | memory | gpus | throughput |\n|---|---|---|---|\n{rows}\n\n"
    steps = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(rng.sample(STEPS, 4)))
    return title + body + table + "## Checklist\n\n" + steps + "\n\n" + prose(rng, EN_PARAS, 1, 3)


STEPS = [
    "Check that the source checkpoint's index lists every shard.",
    "Run the planner to see whether the result fits on the target node.",
    "Convert with the recipe that matches the model family.",
    "Validate the output against the engine's loader rules.",
    "Measure perplexity and divergence on held-out text.",
    "Push the checkpoint and its model card to the hub.",
    "Start the server with the FP8 key-value cache enabled.",
]

# ----------------------------------------------------------------------------------------------- math
def math_problem(rng: random.Random) -> str:
    """A word problem with a worked, arithmetically correct solution."""
    kind = rng.randrange(4)
    name, city, item = rng.choice(NAMES), rng.choice(CITIES), rng.choice(ITEMS)
    if kind == 0:
        boxes, per, sold = rng.randint(3, 19), rng.randint(4, 24), rng.randint(1, 30)
        total = boxes * per
        sold = min(sold, total)
        return (
            f"Problem: {name} has {boxes} boxes of {item} with {per} {item} in each box. "
            f"{name} sells {sold} {item} at the market in {city}. How many {item} are left?\n"
            f"Solution: {boxes} x {per} = {total} {item} in total. {total} - {sold} = {total - sold}.\n"
            f"Answer: {total - sold}"
        )
    if kind == 1:
        speed, hours, extra = rng.randint(20, 90), rng.randint(2, 9), rng.randint(5, 60)
        dist = speed * hours
        return (
            f"Problem: A train leaves {city} and travels at {speed} km/h for {hours} hours, then "
            f"another {extra} km. How far does it travel?\n"
            f"Solution: {speed} x {hours} = {dist} km, and {dist} + {extra} = {dist + extra} km.\n"
            f"Answer: {dist + extra} km"
        )
    if kind == 2:
        price, qty, pct = rng.randint(2, 80), rng.randint(2, 12), rng.choice([10, 20, 25, 50])
        cost = price * qty
        off = cost * pct // 100
        return (
            f"Problem: One of {name}'s {item} costs {price} dollars. {name} buys {qty} of them with a "
            f"{pct}% discount. What does {name} pay?\n"
            f"Solution: {qty} x {price} = {cost}. {pct}% of {cost} is {off}. {cost} - {off} = {cost - off}.\n"
            f"Answer: {cost - off} dollars"
        )
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    return (
        f"Problem: A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?\n"
        f"Solution: area = {a} x {b} = {a * b} square cm; perimeter = 2 x ({a} + {b}) = {2 * (a + b)} cm.\n"
        f"Answer: {a * b} and {2 * (a + b)}"
    )


def math_problem_ko(rng: random.Random) -> str:
    a, b = rng.randint(3, 50), rng.randint(2, 9)
    return (f"문제: 사과가 한 상자에 {a}개씩 {b}상자 있습니다. 사과는 모두 몇 개입니까?\n"
            f"풀이: {a} x {b} = {a * b}\n답: {a * b}개")


def math_problem_zh(rng: random.Random) -> str:
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    return f"题目：小明有{a}本书，送给朋友{b}本，还剩几本？\n解答：{a} - {b} = {a - b}\n答案：{a - b}本"


# ----------------------------------------------------------------------------------------------- code
FUNCS = [
    "def {f}(values: list[float]) -> float:\n"
    '    """Return the mean of {what}."""\n'
    "    if not values:\n"
    "        raise ValueError('empty input')\n"
    "    return sum(values) / len(values)\n",
    "def {f}(rows, key):\n"
    "    groups = {{}}\n"
    "    for row in rows:\n"
    "        groups.setdefault(row[key], []).append(row)\n"
    "    return {{k: len(v) for k, v in sorted(groups.items())}}\n",
    "def {f}(path):\n"
    "    with open(path, encoding='utf-8') as handle:\n"
    "        for number, line in enumerate(handle, start=1):\n"
    "            if '{word}' in line:\n"
    "                yield number, line.rstrip()\n",
    "class {cls}:\n"
    '    """A fixed-size buffer of {what}."""\n\n'
    "    def __init__(self, size: int) -> None:\n"
    "        self.size = size\n"
    "        self.items = []\n\n"
    "    def push(self, item) -> None:\n"
    "        self.items.append(item)\n"
    "        if len(self.items) > self.size:\n"
    "            self.items.pop(0)\n",
    "SELECT {col}, COUNT(*) AS n\nFROM {table}\nWHERE created_at >= '2026-0{m}-01'\nGROUP BY {col}\n"
    "ORDER BY n DESC\nLIMIT {k};\n",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor shard in {table}/*.safetensors; do\n"
    '  sha256sum "$shard" >> {word}.sha256\ndone\necho "checked $(wc -l < {word}.sha256) shards"\n',
    "fn {f}(xs: &[i64]) -> i64 {{\n    xs.iter().filter(|x| **x % {k} == 0).sum()\n}}\n",
]
WORDS = ["token", "expert", "shard", "scale", "layer", "router", "cache", "group", "batch", "weight"]


def code_snippet(rng: random.Random) -> str:
    w = rng.choice(WORDS)
    fill = {
        "f": f"{rng.choice(['load', 'count', 'find', 'merge', 'sum'])}_{w}s",
        "cls": f"{w.capitalize()}Buffer",
        "what": f"{w} values",
        "word": w,
        "col": w,
        "table": f"{w}s",
        "m": rng.randint(1, 9),
        "k": rng.randint(2, 20),
    }
    body = rng.choice(FUNCS).format(**fill)
    lang = "sql" if body.startswith("SELECT") else "bash" if body.startswith("#!") else "code"
    return f"Here is a short {lang} example about {w}s.\n\n```\n{body}```\n"


# ----------------------------------------------------------------------------------------------- chat
def chat_with_tool(rng: random.Random) -> dict:
    """A chat where the assistant calls a tool and then answers from its result."""
    city, name = rng.choice(CITIES), rng.choice(NAMES)
    temp, rain = rng.randint(-5, 35), rng.randint(0, 100)
    kind = rng.randrange(3)
    if kind == 0:
        call = {"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}
        result = {"city": city, "temperature": temp, "rain_probability": rain}
        ask = f"What's the weather like in {city} today? Should I take an umbrella?"
        advice = "take an umbrella" if rain >= 50 else "you can leave the umbrella at home"
        answer = f"It is {temp} degrees in {city} with a {rain}% chance of rain, so {advice}."
    elif kind == 1:
        gb, gpus = rng.choice([421, 705, 595, 1030]), rng.choice([4, 8, 16])
        call = {"name": "plan_memory", "arguments": {"checkpoint_gb": gb, "gpus": gpus}}
        per = round(gb / gpus, 1)
        result = {"per_gpu_weights_gb": per, "fits": per < 120}
        ask = f"Will a {gb} GB checkpoint fit on {gpus} GPUs with 141 GB each?"
        verdict = "fits" if per < 120 else "does not fit once the KV cache is counted"
        answer = f"Each GPU holds about {per} GB of weights, so it {verdict}."
    else:
        a, b = rng.randint(100, 9999), rng.randint(2, 99)
        call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
        result = {"value": a * b}
        ask = f"{name} needs {a} times {b}. Can you compute it exactly?"
        answer = f"{a} x {b} = {a * b}."
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant with access to tools."},
            {"role": "user", "content": ask},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": json.dumps(result)},
            {"role": "assistant", "content": answer},
        ]
    }


def chat_plain(rng: random.Random) -> dict:
    lang = rng.randrange(3)
    if lang == 0:
        q = f"Can you explain {rng.choice(TOPICS)} in a few sentences?"
        a = prose(rng, EN_PARAS, 1, 2)
    elif lang == 1:
        q = "양자화가 왜 디코딩을 빠르게 하나요?"
        a = prose(rng, KO_PARAS, 1, 2)
    else:
        q = "请简单介绍一下键值缓存。"
        a = prose(rng, ZH_PARAS, 1, 2)
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def record(rng: random.Random) -> dict:
    """One corpus record: a `text` document or a chat `messages` list, tagged with its genre."""
    genre = rng.choices(
        ["chat_tool", "chat", "code", "math", "math_ko", "math_zh", "long_doc", "prose_en", "prose_ko",
         "prose_zh"],
        weights=[14, 8, 14, 14, 4, 4, 10, 12, 10, 10],
    )[0]
    makers = {
        "chat_tool": chat_with_tool,
        "chat": chat_plain,
        "code": lambda r: {"text": code_snippet(r)},
        "math": lambda r: {"text": math_problem(r)},
        "math_ko": lambda r: {"text": math_problem_ko(r)},
        "math_zh": lambda r: {"text": math_problem_zh(r)},
        "long_doc": lambda r: {"text": long_document(r)},
        "prose_en": lambda r: {"text": prose(r, EN_PARAS, 2, 4)},
        "prose_ko": lambda r: {"text": prose(r, KO_PARAS, 2, 4)},
        "prose_zh": lambda r: {"text": prose(r, ZH_PARAS, 2, 4)},
    }
    rec = makers[genre](rng)
    rec["genre"] = genre
    return rec


def write(path: Path, seed: int, count: int) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for _ in range(count):
            out.write(json.dumps(record(rng), ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write(HERE / "default.jsonl", seed=2026, count=700)
    write(HERE / "heldout.jsonl", seed=7, count=120)
