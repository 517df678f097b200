"""One client against a running OpenAI-compatible server (kvq-serve or llama-server):
time to the first token of a long prompt, of the same prompt again, and of 100 tokens of
decode at the start of a sequence.

    cargo xtask fetch-model smollm2-135m && cargo xtask fetch-text botchan
    cargo run --release -p kvq-serve -- --addr 127.0.0.1:8080 &
    python3 benches/serve/one_sequence.py 8080 target/texts/botchan.txt
"""

import json
import sys
import time
import urllib.request

port, text_path = sys.argv[1], sys.argv[2]
n_words = int(sys.argv[3]) if len(sys.argv) > 3 else 1500
words = open(text_path).read().split()
prompt = " ".join(words[:n_words])


def request(p, n=1, **extra):
    body = json.dumps({"prompt": p, "max_tokens": n, "temperature": 0, **extra}).encode()
    url = f"http://127.0.0.1:{port}/v1/completions"
    t = time.time()
    r = json.load(urllib.request.urlopen(urllib.request.Request(url, body, {"content-type": "application/json"})))
    return time.time() - t, r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]


first = request(prompt)
again = request(prompt)
decode = request("Once upon a time", 100, ignore_eos=True)
print(f"prompt of {first[1]} tokens: {first[0]:.3f} s to the first token")
print(f"the same prompt again: {again[0]:.3f} s ({first[0] / again[0]:.0f}x faster)")
print(f"{decode[2]} tokens at depth {decode[1]}: {decode[0]:.3f} s ({decode[2] / decode[0]:.1f} tokens/s)")
