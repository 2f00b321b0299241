"""The app's one database: its engine and migrations, and each feature's tables."""
