"""The official OpenAI Python client against kvq-serve on loopback, with kvq's tiny model.

Run by `cargo xtask openai-check` (and so by .ci/run), which installs the `openai` package
into a virtual environment and passes the binaries in KVQ_SERVE_BIN and KVQ_TINY_MODEL_BIN.
Prints one line per check and ends with 'N passed, M failed'.
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

serve_bin = os.environ["KVQ_SERVE_BIN"]
tiny_bin = os.environ["KVQ_TINY_MODEL_BIN"]
work = tempfile.mkdtemp(prefix="kvq-openai-")
model_path = os.path.join(work, "tiny.gguf")
subprocess.run([tiny_bin, model_path], check=True, stdout=subprocess.DEVNULL)

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = subprocess.Popen(
    [serve_bin, "--model", model_path, "--model-id", "tiny", "--addr", f"127.0.0.1:{port}",
     "--pool-mib", "16", "--ctx", "512", "--threads", "1"],
    stderr=open(os.path.join(work, "server.log"), "w"),
)
base = f"http://127.0.0.1:{port}"
passed, failed = 0, 0


def check(name, fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok: {name}")
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
        failed += 1
        print(f"FAILED: {name}: {type(e).__name__}: {e}")


try:
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2).read()
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("kvq-serve did not start: " + open(os.path.join(work, "server.log")).read())
            time.sleep(0.2)

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}

    def models():
        assert [m.id for m in client.models.list().data] == ["tiny"]

    def completion():
        r = client.completions.create(model="tiny", prompt="the keys and values", max_tokens=5, **greedy)
        assert r.object == "text_completion", r
        assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0, r.usage
        assert r.choices[0].finish_reason == "length", r

    def completion_stream():
        whole = client.completions.create(model="tiny", prompt="a stream", max_tokens=6, **greedy)
        parts = client.completions.create(model="tiny", prompt="a stream", max_tokens=6, stream=True, **greedy)
        text = "".join(c.choices[0].text for c in parts if c.choices)
        assert text == whole.choices[0].text, (text, whole.choices[0].text)

    def chat():
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, **greedy)
        assert r.object == "chat.completion", r
        assert r.choices[0].message.role == "assistant", r
        assert r.usage.completion_tokens == 4, r.usage

    def chat_stream():
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, **greedy)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, **greedy))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content, (text, whole.choices[0].message.content)
        assert chunks[-1].usage.completion_tokens == 6, chunks[-1]
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)

    def bad_temperature():
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=7)
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "temperature" in str(e), e
        else:
            raise AssertionError("no error")

    def unknown_model():
        try:
            client.chat.completions.create(model="gpt-none", messages=[{"role": "user", "content": "x"}])
        except openai.NotFoundError as e:
            assert e.status_code == 404, e
        else:
            raise AssertionError("no error")

    for name, fn in [("models", models), ("completion", completion), ("completion stream", completion_stream),
                     ("chat", chat), ("chat stream", chat_stream), ("bad temperature", bad_temperature),
                     ("unknown model", unknown_model)]:
        check(name, fn)
finally:
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()

print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
