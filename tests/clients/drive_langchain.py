"""Drive LangChain's OpenAI clients (langchain-openai) against URL as its users do (for recorder.py):
the chat model invoked and streamed, and the completions LLM."""
import sys

from langchain_openai import ChatOpenAI, OpenAI

url = sys.argv[1] + "/v1"
chat = ChatOpenAI(model="default", base_url=url, api_key="unused", max_tokens=8, max_retries=0)
chat.invoke("Say hi.")
for _ in chat.stream("Say hi."):
    pass
llm = OpenAI(model="default", base_url=url, api_key="unused", max_tokens=8, max_retries=0)
llm.invoke("Hello")
for _ in llm.stream("Hello"):
    pass
