"""Drive the ``openai`` SDK against URL the way its users call it (for recorder.py):
chat and completions, streamed and not, current and previous field names."""
import sys

import openai

url = sys.argv[1]
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
msgs = [{"role": "user", "content": "Say hi."}]
client.chat.completions.create(model="default", messages=msgs, max_tokens=8)
client.chat.completions.create(model="default", messages=msgs, max_completion_tokens=8, temperature=0)
for _ in client.chat.completions.create(model="default", messages=msgs, max_completion_tokens=8, stream=True,
                                        stream_options={"include_usage": True}):
    pass
client.chat.completions.create(model="default", messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2, n=2,
                               seed=1)
client.completions.create(model="default", prompt="Hello", max_tokens=8)
for _ in client.completions.create(model="default", prompt="Hello", max_tokens=8, stream=True,
                                   stream_options={"include_usage": True}):
    pass
client.completions.create(model="default", prompt=["Hello", "Bye"], max_tokens=1, logprobs=1, echo=True)
