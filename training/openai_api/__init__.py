"""The OpenAI protocol on the ground floor, shared by the deployment server and the proxy: the error
envelope, server-sent events, chat messages, tool-call parsers, the chat-template check, and the Responses
API (request, output, stream, store). Nothing here knows the engine, the trainer or the recipes."""
