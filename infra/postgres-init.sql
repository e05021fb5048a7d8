-- The compose file's Postgres holds two databases: Prefect's (created by POSTGRES_DB) and MLflow's.
CREATE DATABASE mlflow;
