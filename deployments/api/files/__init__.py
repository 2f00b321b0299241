"""OpenAI's Files API: uploads, their rows in the app's database, their bytes on disk."""
