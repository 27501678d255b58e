"""Multimodal retrieval: encoders, KB records, the FAISS index, evaluation and the toy world."""

from retrieval.index import MultimodalIndex
from retrieval.ranking import Hit

__all__ = ["Hit", "MultimodalIndex"]
